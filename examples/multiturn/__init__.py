"""Multi-turn KV reuse with kvpush: a tiny paged-KV model, prefill and decode engines that
move KV both ways, a router, and a demo (``python -m examples.multiturn.demo``)."""
