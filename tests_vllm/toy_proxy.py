"""A client that speaks only vLLM's own disaggregation schema, the way vLLM's toy proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``) and a ``NixlPushConnector``
router drive ``NixlConnector`` / ``NixlPushConnector``: no ``kvpush_*`` key is ever sent.

Pull: the prefill instance gets ``do_remote_decode`` with every ``remote_*`` key None and
``max_tokens`` 1 (not streamed); whatever ``kv_transfer_params`` it answers go to the decode
instance unchanged. Push: both instances get the same ``X-Request-Id`` at once; the prefill
``do_remote_decode``, the decode ``do_remote_prefill`` with the prefill's engine id, host,
port and TP size. Written from the schema, for kvpush's tests; the request shaping is split
from the HTTP so the scheduler half can be driven without servers.
"""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid
from typing import Any


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the proxy sends the prefill instance (pull and push alike)."""
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "remote_engine_id": None, "remote_block_ids": None,
                                 "remote_host": None, "remote_port": None}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out


def decode_body_pull(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode request of a pull: the prefill's ``kv_transfer_params`` as they came."""
    out = dict(body)
    params = prefill_response.get("kv_transfer_params")
    if params:
        out["kv_transfer_params"] = params
    return out


def decode_body_push(body: dict[str, Any], *, engine_id: str, host: str, port: int,
                     tp_size: int, request_id: str) -> dict[str, Any]:
    """The decode request of a push, sent together with the prefill's."""
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                 "remote_engine_id": engine_id, "remote_host": host,
                                 "remote_port": port, "tp_size": tp_size,
                                 "remote_request_id": request_id}
    return out


def _post(url: str, body: dict[str, Any], request_id: str,
          timeout: float) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": request_id})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")[:2000]}


class ToyProxy:
    """One prefill and one decode server, addressed by base URL (``http://host:port``)."""

    def __init__(self, prefill_url: str, decode_url: str, *, prefill_kv_host: str = "",
                 prefill_kv_port: int = 0, prefill_engine_id: str = "prefill",
                 prefill_tp_size: int = 1) -> None:
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.kv_host, self.kv_port = prefill_kv_host, prefill_kv_port
        self.engine_id, self.tp_size = prefill_engine_id, prefill_tp_size

    def pull(self, body: dict[str, Any], path: str = "/v1/completions",
             timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
        rid = str(uuid.uuid4())
        status, first = _post(self.prefill_url + path, prefill_body(body), rid, timeout)
        if status != 200:
            return status, first
        return _post(self.decode_url + path, decode_body_pull(body, first), rid, timeout)

    def push(self, body: dict[str, Any], path: str = "/v1/completions",
             timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
        rid = str(uuid.uuid4())
        prefill: dict[str, Any] = {}

        def run_prefill() -> None:
            prefill["result"] = _post(self.prefill_url + path, prefill_body(body), rid,
                                      timeout)

        thread = threading.Thread(target=run_prefill, daemon=True)
        thread.start()
        try:
            return _post(self.decode_url + path,
                         decode_body_push(body, engine_id=self.engine_id, host=self.kv_host,
                                          port=self.kv_port, tp_size=self.tp_size,
                                          request_id=rid), rid, timeout)
        finally:
            thread.join(timeout)
