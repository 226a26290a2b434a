"""Adapters that plug kvpush into serving engines.

* :mod:`kvpush.integrations.vllm` -- ``KVPushConnector``, a vLLM v1 KV connector (load it
  with ``kv_connector_module_path``). Importing it imports vLLM; importing :mod:`kvpush` or
  this package never does.
"""
