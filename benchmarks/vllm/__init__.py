"""kvpush in real vLLM servers (CPU), run with ``.venv-vllm`` (``bash .ci/bootstrap-vllm``):

* :mod:`benchmarks.vllm.compare` -- kvpush against vLLM's own NIXL connectors, side by side
  (``python -m benchmarks.vllm.compare``);
* :mod:`benchmarks.vllm.layerwise` -- layer-wise push against whole-request push
  (``python -m benchmarks.vllm.layerwise``);
* :mod:`benchmarks.vllm.stages` -- where a request's time to first token goes, from the
  servers' stage logs (``python -m benchmarks.vllm.stages LOG_OR_DIR``);
* :mod:`benchmarks.vllm.anchors` -- the do-nothing and no-spin connectors the comparison
  loads into vLLM (by the module name ``anchors``, with this folder on the servers'
  ``PYTHONPATH``: the repository root there would put the checkout's ``kvpush/`` before
  the one ``.venv-vllm`` builds for them).

Importing this package imports nothing of vLLM's.
"""
