"""Hugging Face interchange: the mapping between jaxtrain's parameters and a Hugging Face checkpoint's tensors
(names, layouts, the config fields; :mod:`.mapping` for the dense classes, Llama, Mistral, Qwen2/2.5 and Qwen3, whose
options :mod:`.families` reads; :mod:`.moe_mapping` for Mixtral, :mod:`.qwen_moe` for Qwen3-MoE and Qwen2-MoE,
:mod:`.deepseek` for DeepSeek-V3), import and export of safetensors checkpoints with their tokenizer files
(:mod:`.convert`), and KV-cached greedy or sampled generation from a checkpoint (:mod:`.generate`).

May import: errors, config, rundir, models, parallel (the layout a model is restored onto) and checkpoint. Never
torch or transformers: their parity is checked by the tests, not needed at run time.
"""
