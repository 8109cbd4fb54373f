"""`Proxy`: one client request through the router: the prefill stage (which instance, what when it fails) and the
decode stage (which instance, relaying its answer)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response

from deltaserve.entrypoints.router.bodies import Route, can_prefill_remotely, decode_body, prefill_body, wants_stream
from deltaserve.entrypoints.router.config import RouterTimeouts
from deltaserve.entrypoints.router.errors import error_response
from deltaserve.entrypoints.router.instances import Instance, InstancePool, Lease, Pools
from deltaserve.entrypoints.router.metrics import RouterMetrics
from deltaserve.entrypoints.router.relay import InstanceDown, read_body, relay_stream, relayed_headers, unless_down

logger = logging.getLogger(__name__)

# Client headers an instance needs: credentials (the instances check them), API version headers, the session id
# the data-parallel router of an instance reads.
_FORWARDED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta", "x-session-id",
                      "x-request-id", "content-type", "accept")


@dataclass(frozen=True, slots=True, kw_only=True)
class Upstream:
    """What a request sends to an instance."""

    method: str
    path: str
    content: bytes
    headers: Mapping[str, str]


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client headers passed on to instances."""
    return {name: headers[name] for name in _FORWARDED_HEADERS if name in headers}


class Proxy:
    """Sends requests to the instances of `pools` over `client`, counting what happens in `metrics`."""

    def __init__(self, timeouts: RouterTimeouts, pools: Pools, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.pools = pools
        self.metrics = metrics
        self.client = client
        self._prefill_timeout = httpx.Timeout(timeouts.prefill_timeout_s, connect=timeouts.connect_timeout_s)
        self._decode_timeout = httpx.Timeout(timeouts.decode_timeout_s, connect=timeouts.connect_timeout_s)
        self._logged: set[tuple[str, str]] = set()
        # True from a request that found no healthy prefill instance until a prefill succeeds (logged once).
        self._prefill_outage = False

    async def handle(self, route: Route, raw: bytes, headers: Mapping[str, str]) -> Response:
        """A POST on `route`: prefill (when the route and body allow), then decode, relayed to the client."""
        self.metrics.requests.labels(route.path).inc()
        if not self.pools.decode.num_healthy:  # no prefill either: nobody could use it
            return no_decode_instance(route, "no decode instance is healthy")
        forwarded = forwarded_headers(headers)
        try:
            body = json.loads(raw)
        except ValueError:  # not JSON: the decode instance answers the client's mistake
            body = None
        if isinstance(body, dict) and can_prefill_remotely(route, body):
            params = await self._prefill(route, body, forwarded)
            raw = json.dumps(decode_body(body, params)).encode()
            forwarded["content-type"] = "application/json"
        return await self.decode(route, Upstream(method="POST", path=route.path, content=raw, headers=forwarded),
                                 stream=wants_stream(body))

    async def _prefill(self, route: Route, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        """The `kv_transfer_params` of a prefill instance for `body`, trying each healthy one until one answers;
        None (counted and logged: the decode instance prefills locally) when none can."""
        pool = self.pools.prefill
        if not pool.instances:
            return None
        content = json.dumps(prefill_body(route, body)).encode()
        tried: set[str] = set()
        while (instance := pool.pick(tried)) is not None:
            tried.add(instance.url)
            outcome = await self._prefill_on(pool, instance, route.path, content, headers)
            if isinstance(outcome, dict):
                self._prefill_outage = False
                return outcome
            if outcome is not None:  # the instance answered, without a transfer: no other would do better
                self.metrics.fallbacks.labels(outcome).inc()
                self._log_once(instance, outcome)
                return None
        reason = "prefill_failed" if tried else "no_healthy_prefill_instance"
        self.metrics.fallbacks.labels(reason).inc()
        if tried or not self._prefill_outage:  # each failure, but an outage of the whole pool once
            logger.warning("%s (%d tried): the decode instance prefills locally", reason.replace("_", " "),
                           len(tried))
        self._prefill_outage = not tried
        return None

    async def _prefill_on(self, pool: InstancePool, instance: Instance, path: str, content: bytes,
                          headers: dict[str, str]) -> dict[str, Any] | str | None:
        """One prefill attempt: the transfer params; a fallback reason (the instance answered without them: a
        4xx for the client's body, or no transfer); None when the instance failed (counted; try another)."""
        lease = self._acquire(pool, instance)
        try:
            response = await unless_down(
                self.client.post(f"{instance.url}{path}", content=content, headers=headers,
                                 timeout=self._prefill_timeout), lease.down)
        except (httpx.HTTPError, InstanceDown) as exc:
            reason = _failure_reason(exc)
            self._prefill_failed(pool, instance, reason, mark_down=isinstance(exc, httpx.ConnectError | InstanceDown))
            return None
        finally:
            lease.release()
        if response.status_code >= 500 or response.status_code == 429:  # its failure or its queue: another may do
            self._prefill_failed(pool, instance, f"status_{response.status_code}",
                                 mark_down=response.status_code == 503)
            return None
        if response.status_code >= 400:
            return "prefill_rejected"
        try:
            params = response.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            self._prefill_failed(pool, instance, "bad_answer", mark_down=False)
            return None
        return params if isinstance(params, dict) else "no_kv_transfer_params"

    def _log_once(self, instance: Instance, outcome: str) -> None:
        # Once per instance and kind: a prefill instance without a KV connector answers every request so.
        if (instance.url, outcome) not in self._logged:
            self._logged.add((instance.url, outcome))
            logger.warning("prefill on %s: %s; the decode instance prefills locally (logged once; counted in "
                           "deltaserve:router_local_prefill_fallbacks)", instance.url, outcome)

    def _prefill_failed(self, pool: InstancePool, instance: Instance, reason: str, *, mark_down: bool) -> None:
        self.metrics.prefill_failures.labels(instance.url, reason).inc()
        logger.warning("prefill on %s failed (%s)", instance.url, reason)
        if mark_down:
            pool.mark_down(instance, reason)

    async def decode(self, route: Route, upstream: Upstream, *, stream: bool) -> Response:
        """Send `upstream` to a healthy decode instance and relay its answer. An instance that refuses the
        connection or answers 503 before the request starts there is skipped for another; one that fails once
        the request runs ends it with a 503 (an error event in a stream already started)."""
        pool = self.pools.decode
        tried: set[str] = set()
        last = "no decode instance is healthy"
        while (instance := pool.pick(tried)) is not None:
            tried.add(instance.url)
            lease = self._acquire(pool, instance)
            try:
                response = await unless_down(self._send(instance, upstream), lease.down)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached the instance
                lease.release()
                last = self._decode_failed(instance, _failure_reason(exc))
                continue
            except (httpx.HTTPError, InstanceDown) as exc:
                lease.release()
                self._decode_failed(instance, _failure_reason(exc))
                return _instance_failed(route)
            except BaseException:  # cancelled: the client left (the instance saw the connection close)
                lease.release()
                raise
            if response.status_code == 503:  # draining or its engine died: the request did not start there
                lease.release()
                await response.aclose()
                last = self._decode_failed(instance, "status_503")
                continue
            return await self._relay(route, instance, lease, response, stream)
        return no_decode_instance(route, last)

    def _acquire(self, pool: InstancePool, instance: Instance) -> Lease:
        self.metrics.instance_requests.labels(pool.role, instance.url).inc()
        return pool.acquire(instance)

    async def _send(self, instance: Instance, upstream: Upstream) -> httpx.Response:
        request = self.client.build_request(upstream.method, f"{instance.url}{upstream.path}",
                                            content=upstream.content or None, headers=upstream.headers,
                                            timeout=self._decode_timeout)
        return await self.client.send(request, stream=True)

    async def _relay(self, route: Route, instance: Instance, lease: Lease, response: httpx.Response,
                     stream: bool) -> Response:
        if stream and response.status_code == 200:
            return relay_stream(response, lease, route.api, lambda reason: self._decode_failed(instance, reason))
        try:
            content = await read_body(response, lease.down)
        except (httpx.HTTPError, InstanceDown) as exc:
            self._decode_failed(instance, _failure_reason(exc))
            return _instance_failed(route)
        finally:
            await response.aclose()
            lease.release()
        return Response(content, status_code=response.status_code, headers=relayed_headers(response))

    def _decode_failed(self, instance: Instance, reason: str) -> str:
        self.metrics.decode_failures.labels(instance.url, reason).inc()
        logger.warning("decode on %s failed (%s)", instance.url, reason)
        if reason != "timeout":  # a slow instance is not a dead one; its health checks decide
            self.pools.decode.mark_down(instance, reason)
        return f"{instance.url}: {reason}"


def no_decode_instance(route: Route, why: str) -> Response:
    """The 503 of a request no decode instance can take."""
    return error_response(route.api, 503, f"no decode instance can take the request ({why}); retry later",
                          code="no_decode_instance")


def _instance_failed(route: Route) -> Response:
    return error_response(route.api, 503, "the decode instance failed while running the request; retry it",
                          code="decode_instance_failed")


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, InstanceDown):
        return "unhealthy"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return type(exc).__name__
