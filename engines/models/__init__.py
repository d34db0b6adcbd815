"""The model library: rollflow's decoder (decoder.py, MoE in moe.py, LoRA in lora.py), transformers' models
behind the same interface (hf.py), model families (families.py: config.json <-> ModelConfig, registered by
name or entry point), model directories and publications (modeldir.py), tokenizers (tokenizer.py) and
`rollflow models fetch` (fetch.py). Used by the trainer, the embedded engine and (torch-free parts only:
modeldir, families, tokenizer) the orchestrator."""
