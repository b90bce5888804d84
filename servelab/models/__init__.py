"""Models: a Llama-family decoder (Llama, Qwen2, Mistral) that loads Hugging
Face checkpoint folders (``config.json`` + ``*.safetensors``) and runs attention
over the paged KV cache, and ``build_tiny_model`` for random tiny checkpoints
(the demo's default and the tests' fixtures). (Not built yet: see the pipeline
issue.)
"""
