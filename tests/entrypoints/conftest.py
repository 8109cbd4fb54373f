"""The live server used by the end-to-end HTTP tests (started once per session)."""

from __future__ import annotations

import pytest

from tests.entrypoints.server_fixture import start_server, stop_server


@pytest.fixture(scope="session")
def server(tiny_dir, tmp_path_factory):
    live = start_server(tiny_dir("base"), tmp_path_factory.mktemp("server"), "--max-model-len", "2048",
                        "--max-n", "4", "--max-request-bytes", "300000")
    yield live
    stop_server(live)
