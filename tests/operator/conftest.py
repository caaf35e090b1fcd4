"""The emulated cluster every operator test on kmock runs against."""

from __future__ import annotations

from collections.abc import AsyncIterator

import kmock
import pytest_asyncio

from tests.support.kmock import NS, RESOURCES, APIServer


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[APIServer]:
    async with APIServer() as k, kmock.Server(k):
        for resource, (kind, namespaced, subresources) in RESOURCES.items():
            k.resources[resource] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                subresources=subresources,
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            )
        # Set directly: kmock cannot parse the cluster-scoped URL of namespaces.
        k.objects["v1/namespaces", None, NS] = {"metadata": {"name": NS}}
        yield k
