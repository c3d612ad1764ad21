"""Simulated instances as separate processes behind vLLM's HTTP API (``qlm sim-engine serve``),
so that a demo or a test drives them exactly as production drives vLLM: through ``VllmEngine``
over HTTP. ``QLM_CONTROLLER__SIM_OVER_HTTP=true`` (or ``qlm serve --sim-http``) turns the embedded
default's in-process instances into such processes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from qlm.errors import ConfigError, QLMError
from qlm.service.instances import InstanceConfig

START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SimServers:
    """One ``qlm sim-engine serve`` process per simulated instance; ``stop()`` ends them."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    async def start(
        self, configs: Sequence[InstanceConfig], *, time_scale: float = 1.0
    ) -> list[InstanceConfig]:
        """Start a server for each config and return the configs pointing at them (healthy)."""
        out = []
        for config in configs:
            spec = config.spec
            if len(spec.models) != 1:
                raise ConfigError(
                    f"QLM_CONTROLLER__SIM_OVER_HTTP: instance {spec.name} serves "
                    f"{len(spec.models)} models; a simulated server serves one"
                )
            port = _free_port()
            args = [sys.executable, "-m", "qlm.cli", "sim-engine", "serve"]
            args += ["--model", spec.models[0], "--gpu", spec.gpu, "--gpus", str(spec.gpu_count)]
            args += ["--port", str(port), "--time-scale", str(time_scale), "--dev-mode"]
            # as `qlm instance launch` starts vLLM: the agents send priorities
            args += ["--scheduling-policy", "priority"]
            self.procs.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            url = f"http://127.0.0.1:{port}"
            out.append(dataclasses.replace(config, spec=dataclasses.replace(spec, url=url)))
        try:
            await asyncio.gather(
                *(self._wait(p, c.spec.url) for p, c in zip(self.procs, out, strict=True))
            )
        except BaseException:
            self.stop()
            raise
        return out

    async def _wait(self, proc: subprocess.Popen[bytes], url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        async with httpx.AsyncClient(timeout=1.0) as client:
            while True:
                if proc.poll() is not None:
                    raise QLMError(f"qlm sim-engine serve for {url} exited with {proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise QLMError(f"qlm sim-engine serve at {url} did not become healthy")
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
