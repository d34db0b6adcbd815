# rendered by rollflow (launch/vllm.py); one line per process
# replica 0: entry http://127.0.0.1:8100
# vllm-r0 on {node0}
PYTHONPATH='{worker_path}' VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model '{model}' --served-model-name rollflow --max-model-len 64 --dtype float32 --seed 0 --worker-extension-cls rollflow_vllm_worker.WeightLoader --middleware rollflow_vllm_auth.RequireToken --tensor-parallel-size 2 --data-parallel-size 4 --enable-expert-parallel --host 127.0.0.1 --port 8100
