# rendered by rollflow (launch/vllm.py); one line per process
# replica 0: entry http://{node0}:8000
# mooncake-master-r0 on {node0}
cat > {config_dir}/mooncake-r0.json <<'EOF'
{"global_segment_size": 0, "master_server_address": "{node0}:50051", "metadata_server": "http://{node0}:8080/metadata", "mode": "standalone-store", "protocol": "rdma"}
EOF
mooncake_master --rpc_port=50051 --enable_http_metadata_server=true --http_metadata_server_port=8080
# mooncake-client-r0-node0 on {node0}
mooncake_client '--master_server_address={node0}:50051' --global_segment_size=128000000000 --storage_root_dir=/scratch/kv
# mooncake-client-r0-node1 on {node1}
mooncake_client '--master_server_address={node0}:50051' --global_segment_size=128000000000 --storage_root_dir=/scratch/kv
# vllm-r0-node0 on {node0}
MOONCAKE_CONFIG_PATH='{config_dir}/mooncake-r0.json' PYTHONPATH='{worker_path}' VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model '{model}' --served-model-name rollflow --max-model-len 64 --dtype float32 --seed 0 --worker-extension-cls rollflow_vllm_worker.WeightLoader --middleware rollflow_vllm_auth.RequireToken --tensor-parallel-size 1 --data-parallel-size 1 --kv-transfer-config '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}' --enable-prefix-caching --host '{node0}' --port 8100
# vllm-r0-node1 on {node1}
MOONCAKE_CONFIG_PATH='{config_dir}/mooncake-r0.json' PYTHONPATH='{worker_path}' VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model '{model}' --served-model-name rollflow --max-model-len 64 --dtype float32 --seed 0 --worker-extension-cls rollflow_vllm_worker.WeightLoader --middleware rollflow_vllm_auth.RequireToken --tensor-parallel-size 1 --data-parallel-size 1 --kv-transfer-config '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}' --enable-prefix-caching --host '{node1}' --port 8101
# router-r0 on {node0}
.venv-vllm/bin/vllm-router --host '{node0}' --port 8000 --policy consistent_hash --prometheus-host '{node0}' --prometheus-port 29000 --worker-urls 'http://{node0}:8100' 'http://{node1}:8101'
