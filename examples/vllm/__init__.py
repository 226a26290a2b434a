"""kvpush in real vLLM: a launcher for prefill/decode servers (``launch``), the router that
pairs them (``router``), a tiny offline model (``make_tiny_model``) and an end-to-end demo
(``python -m examples.vllm.demo`` from the repository root)."""
