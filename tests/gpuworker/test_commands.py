"""The worker's management commands, run as an operator runs them: `python manage.py ...`.

They need no database: the commands skip system and migration checks.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import TEST_SECONDS, run_async
from tests.gpuworker.test_frames import png_b64

PROJECT_DIR = Path(__file__).resolve().parents[2]


def command_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MEMORY_MODE", "MODELS_DIR", "WORKER_TOKEN")}
    env.update({"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "potocolom.settings",
                "DATABASE_URL": "sqlite:////nonexistent-folder/never-opened.sqlite3"})
    return env


async def manage(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "manage.py", *args, cwd=PROJECT_DIR, env={**command_env(), **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


def worker_args(fake: FakeApi, models_dir: Path, token: str | None) -> list[str]:
    """runworker_gpu's flags for a test; token None: no --token (a file or WORKER_TOKEN gives it)."""
    return ["runworker_gpu", "--api", fake.url, *(["--token", token] if token is not None else []), "--device",
            "cpu", "--models-dir", str(models_dir), "--threads", "1", "--worker-id", "command-test:0",
            "--memory-mode", "full"]


async def stop(process: asyncio.subprocess.Process) -> str:
    """SIGTERM, then the exit and stderr (asserted to be a clean exit)."""
    process.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)
    assert process.returncode == 0, stderr.decode()[-2000:]
    return stderr.decode()


def test_it_prints_the_manifest_path_last(tmp_path: Path) -> None:
    async def body() -> None:
        target = tmp_path / "relative-dir"
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(PROJECT_DIR / "manage.py"), "make_tiny_model", "relative-dir", cwd=tmp_path,
            env=command_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await process.communicate()

        assert process.returncode == 0, stderr.decode()[-2000:]
        last = stdout.decode().strip().splitlines()[-1]
        assert last == str(target / "manifest.json")
        assert Path(last).is_absolute() and Path(last).is_file()
        assert (target / "unet" / "diffusion_pytorch_model.safetensors").is_file()

    run_async(body())


def test_it_serves_jobs_as_a_command_and_stops_on_sigterm(models_dir: Path) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            process = await manage(*worker_args(fake, models_dir, "secret"))
            try:
                hello = await fake.next_message("hello", timeout=TEST_SECONDS)
                job_id = await fake.job({"prompt": "a red circle", "width": 64, "height": 64, "steps": 2})
                result = await fake.next_message("job_result", job_id=job_id)
            finally:
                process.send_signal(signal.SIGTERM)
                _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)

            assert process.returncode == 0, stderr.decode()[-2000:]
            assert hello["worker_id"] == "command-test:0"
            assert [m["model_id"] for m in hello["models"]] == ["tiny-sd"]
            (model,) = hello["models"]  # frames measured at load: slots depend on this machine's speed
            assert model["frame_ms_p95"] > 0 and model["realtime"] == (model["realtime_slots"] > 0)
            assert result["images"] and result["rung"] == "full"
            assert f"job {job_id}" in stderr.decode()  # one log line per job
            assert "realtime slot(s) within 500 ms" in stderr.decode()  # what the measurement found

    run_async(body())


def test_it_runs_every_frame_alone_with_max_batch_1(models_dir: Path) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            process = await manage(*worker_args(fake, models_dir, "secret"), "--frame-budget-ms", "60000",
                                   "--max-batch", "1")
            try:
                await fake.next_message("hello", timeout=TEST_SECONDS)
                for session_id in ("s-1", "s-2"):
                    assert (await fake.session_start(session_id))["type"] == "session_accepted"
                for session_id in ("s-1", "s-2"):  # back to back: batched together were batching on
                    await fake.frame(session_id, 1, png_b64((200, 30, 30)))
                results = [await fake.next_message("frame_result", session_id=s) for s in ("s-1", "s-2")]
            finally:
                process.send_signal(signal.SIGTERM)
                _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)

            assert process.returncode == 0, stderr.decode()[-2000:]
            assert [result["batch_size"] for result in results] == [1, 1]
            assert "at most 1 per pipeline call (batching off)" in stderr.decode()

    run_async(body())


def test_it_refuses_a_max_batch_below_1(models_dir: Path) -> None:
    async def body() -> None:
        process = await manage("runworker_gpu", "--api", "ws://127.0.0.1:9", "--token", "t", "--device", "cpu",
                               "--models-dir", str(models_dir), "--max-batch", "0")
        _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)

        assert process.returncode != 0 and "--max-batch: expected at least 1, got 0" in stderr.decode()

    run_async(body())


def test_it_exits_with_an_error_when_the_token_is_refused(models_dir: Path) -> None:
    async def body() -> None:
        async with FakeApi(refuse_token=True) as fake:
            process = await manage(*worker_args(fake, models_dir, "wrong"), "--no-realtime")
            _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)

        assert process.returncode != 0
        assert "refused the worker token" in stderr.decode()
        assert "realtime slot" not in stderr.decode()  # --no-realtime measures nothing

    run_async(body())


def test_it_exits_with_an_error_for_a_model_that_is_not_installed(models_dir: Path) -> None:
    async def body() -> None:
        process = await manage("runworker_gpu", "--api", "ws://127.0.0.1:9", "--token", "t", "--device", "cpu",
                               "--models-dir", str(models_dir), "--models", "tiny-sd,missing-model")
        _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)

        assert process.returncode != 0
        assert "missing-model" in stderr.decode() and "not installed" in stderr.decode()

    run_async(body())


def test_it_stays_connected_with_no_models_when_none_fits_its_vram_budget(models_dir: Path) -> None:
    async def body() -> None:
        async with FakeApi(token="from-env", heartbeat_seconds=0.2) as fake:
            process = await manage(*worker_args(fake, models_dir, None), "--memory-mode", "auto",
                                   "--vram-mib", "16", env={"WORKER_TOKEN": "from-env"})
            try:
                hello = await fake.next_message("hello", timeout=TEST_SECONDS)
                await fake.next_message("heartbeat")
                await fake.next_message("heartbeat")  # still there, a period later
            finally:
                text = await stop(process)

        assert hello["models"] == [] and hello["protocol"] == 2
        assert fake.authorizations == ["Token from-env"]  # WORKER_TOKEN, in the header
        assert "model tiny-sd is not served: it fits on no rung: 16 MiB free; full needs" in text
        assert "no model fits this worker's memory (tiny-sd: fits on no rung" in text

    run_async(body())


def test_it_reads_its_token_from_a_file_before_worker_token(models_dir: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "worker-token"
    token_file.write_text("from-file\n", encoding="utf-8")

    async def body() -> None:
        async with FakeApi(token="from-file") as fake:
            process = await manage(*worker_args(fake, models_dir, None), "--no-realtime", "--token-file",
                                   str(token_file), env={"WORKER_TOKEN": "not-this-one"})
            try:
                hello = await fake.next_message("hello", timeout=TEST_SECONDS)
            finally:
                await stop(process)

        assert [m["model_id"] for m in hello["models"]] == ["tiny-sd"]
        assert fake.paths == ["/ws/worker/"] and fake.authorizations == ["Token from-file"]

    run_async(body())


@pytest.mark.parametrize(("token_args", "content", "error"), [
    ([], None, "a worker token is required: --token TOKEN, --token-file PATH or WORKER_TOKEN"),
    (["--token-file", "{dir}/missing"], None, "--token-file {dir}/missing: cannot read it"),
    (["--token-file", "{dir}/token"], "\n", "--token-file {dir}/token is empty"),
    (["--token", "  "], None, "--token is empty"),
])
def test_it_refuses_to_start_without_a_usable_token(tmp_path: Path, token_args: list[str], content: str | None,
                                                    error: str) -> None:
    if content is not None:
        (tmp_path / "token").write_text(content, encoding="utf-8")

    async def body() -> None:
        process = await manage("runworker_gpu", "--api", "ws://127.0.0.1:9", "--device", "cpu",
                               *(arg.format(dir=tmp_path) for arg in token_args))
        _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)

        assert process.returncode != 0 and error.format(dir=tmp_path) in stderr.decode()

    run_async(body())


def test_it_leaves_torch_and_diffusers_unimported_until_the_worker_starts() -> None:
    code = ("import sys\n"
            "import fleet.management.commands.runworker_gpu, fleet.management.commands.make_tiny_model\n"
            "import gpuworker.worker, gpuworker.main, gpuworker.installed, gpuworker.tiny\n"
            "import gpuworker.ladder, gpuworker.vram, gpuworker.loading, gpuworker.footprints\n"
            "heavy = sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules)\n"
            "assert not heavy, heavy\n")

    async def body() -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, cwd=PROJECT_DIR, env=command_env(), stderr=asyncio.subprocess.PIPE)
        _, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()[-2000:]

    run_async(body())
