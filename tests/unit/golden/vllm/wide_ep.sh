# rendered by rollflow (launch/vllm.py); one line per process
# replica 0: entry http://{node0}:8000
# vllm-r0-node0 on {node0}
PYTHONPATH='{worker_path}' VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model '{model}' --served-model-name rollflow --max-model-len 64 --dtype float32 --seed 0 --worker-extension-cls rollflow_vllm_worker.WeightLoader --middleware rollflow_vllm_auth.RequireToken --tensor-parallel-size 2 --data-parallel-size 8 --enable-expert-parallel --data-parallel-size-local 4 --data-parallel-start-rank 0 --data-parallel-address '{node0}' --data-parallel-rpc-port 13345 --data-parallel-hybrid-lb --host '{node0}' --port 8100
# vllm-r0-node1 on {node1}
PYTHONPATH='{worker_path}' VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model '{model}' --served-model-name rollflow --max-model-len 64 --dtype float32 --seed 0 --worker-extension-cls rollflow_vllm_worker.WeightLoader --middleware rollflow_vllm_auth.RequireToken --tensor-parallel-size 2 --data-parallel-size 8 --enable-expert-parallel --data-parallel-size-local 4 --data-parallel-start-rank 4 --data-parallel-address '{node0}' --data-parallel-rpc-port 13345 --data-parallel-hybrid-lb --host '{node1}' --port 8101
# router-r0 on {node0}
.venv-vllm/bin/vllm-router --host '{node0}' --port 8000 --policy consistent_hash --prometheus-host '{node0}' --prometheus-port 29000 --worker-urls 'http://{node0}:8100' 'http://{node1}:8101'
