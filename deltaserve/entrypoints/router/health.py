"""Background health checks: GET /health of every instance every `health_interval_s`."""

from __future__ import annotations

import asyncio
import logging

import httpx

from deltaserve.entrypoints.router.instances import Instance, InstancePool, Pools

logger = logging.getLogger(__name__)


async def check_instance(client: httpx.AsyncClient, pool: InstancePool, instance: Instance, timeout_s: float) -> None:
    """One check: 200 marks the instance healthy, anything else (a status, no answer in time) unhealthy."""
    try:
        response = await client.get(f"{instance.url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        pool.mark_down(instance, f"/health: {type(exc).__name__}")
        return
    if response.status_code == 200:
        pool.mark_up(instance)
    else:
        pool.mark_down(instance, f"/health answered {response.status_code}")


async def check_all(client: httpx.AsyncClient, pools: Pools, timeout_s: float) -> None:
    """Check every instance at once."""
    await asyncio.gather(*(check_instance(client, pool, inst, timeout_s) for pool, inst in pools.all()))


async def run_health_checks(client: httpx.AsyncClient, pools: Pools, interval_s: float, timeout_s: float) -> None:
    """Check every instance every `interval_s` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await check_all(client, pools, timeout_s)
