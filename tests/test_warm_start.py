"""Warm starts (distlab.launchers.warm_start): CPU ranks and their torchrun agents forked from
one interpreter that imported torch and transformers once per run. A warm rank must be the
process a fresh start would have been: the same losses, its launch identity seen by the
hygiene checks, its life tied to the process its launcher started, its exit status passed on."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from distlab.launchers import warm_checks, warm_start
from distlab.launchers.environment import warm_start_environment
from distlab.launchers.process import launch_of, processes_of
from distlab.launchers.warm_server import PRELOAD

from warm_fixtures import copies_of, server, server_log, server_pid  # noqa: F401 - server: a fixture

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_warm_rank_trains_exactly_what_a_fresh_rank_trains(server, prepared, tmp_path, monkeypatch):
    from tests.conftest import resolve, run_experiment

    spec = resolve({"strategy": "ddp", "world_size": 2}, steps=4, untimed_steps=1)
    fresh = run_experiment(prepared, tmp_path / "fresh", spec)
    monkeypatch.setenv(warm_start.SOCKET_ENV, server)
    warm = run_experiment(prepared, tmp_path / "warm", spec)
    assert fresh["timeline"]["start"] == "fresh interpreter"
    assert warm["timeline"]["start"].startswith("forked from the run's warm interpreter"), warm["timeline"]
    assert warm["loss"]["per_step"] == fresh["loss"]["per_step"]
    # each rank says how it started beside its memory figures
    assert all(r["start"] == "fresh interpreter" for r in fresh["memory"]["per_rank"])
    assert all(r["start"].startswith("forked from") for r in warm["memory"]["per_rank"]), warm["memory"]
    # the copy skipped the imports: its first phase is the hand-over, not torch's import
    first = {run: record["timeline"]["phases"][0]["cpu_s"] for run, record in (("fresh", fresh), ("warm", warm))}
    assert first["warm"] < first["fresh"] / 5, first
    assert copies_of(server) == []  # every copy reaped and its record gone


def stand_in(server: str, job: Path, identity: str, out: Path,
             prefix: str = "") -> tuple[subprocess.Popen, psutil.Process]:
    """A rank's process as torchrun starts it, with a warm server offered, under a parent that
    carries the launch identity (as torchrun's agent does; the rank checks it first). prefix: a
    command that execs the rank (in another context)."""
    import socket

    with socket.socket() as probe:  # a free loopback port for the 1-rank process group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(warm_start_environment(), **{warm_start.SOCKET_ENV: server, "DISTLAB_LAUNCH": identity,
                                            "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    rank = f"{prefix} {sys.executable} -m distlab.launchers.entry distlab.rank.worker --job {job}"
    # The agent dies with this process (a pytest killed by a timeout once left a stand-in training
    # for 20 minutes on a core of its own); the rank dies with the agent (its die_with_parent).
    from distlab.launchers.process import die_with_parent

    tests = os.getpid()
    agent = subprocess.Popen(["sh", "-c", f"{rank} > {out} 2>&1; echo status $? >> {out}"], env=env, cwd=REPO,
                             start_new_session=True, preexec_fn=lambda: die_with_parent(tests))
    deadline = time.monotonic() + 30
    while not psutil.Process(agent.pid).children() and time.monotonic() < deadline:
        time.sleep(0.02)
    (rank_process,) = psutil.Process(agent.pid).children()
    return agent, rank_process


def test_a_warm_rank_passes_on_its_exit_status_and_its_error(server, tmp_path):
    agent, _ = stand_in(server, tmp_path / "missing-job.json", "warmtest-1", tmp_path / "out")
    agent.wait(timeout=60)
    out = (tmp_path / "out").read_text()
    assert out.endswith("status 1\n"), out
    assert "missing-job.json" in out and "Traceback" in out, out  # the copy's error, in the stand-in's output


def test_a_copy_carries_its_launch_identity_dies_with_its_stand_in_and_takes_signals(server, prepared, tmp_path):
    from tests.conftest import resolve
    from distlab.records.job import Job

    spec = resolve({"strategy": "ddp", "world_size": 1}, steps=100000, untimed_steps=1)
    job = Job(spec=spec, run_dir=str(tmp_path / "run"), data_dir=str(prepared / "data32"),
              model_source=str(prepared / "model"), hardware_json=str(prepared / "hardware.json"),
              env_allowlist=[], checkpoint_dir=None)
    job_path = tmp_path / "job.json"
    job.write(job_path)
    identity = "warmtest-2"
    for ending in ("stand-in killed", "SIGTERM forwarded"):
        agent, rank = stand_in(server, job_path, identity, tmp_path / "out")
        deadline = time.monotonic() + 60
        while not copies_of(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        (copy,) = copies_of(server)
        # the hygiene checks find the copy by its launch (a fork keeps the server's environ)
        assert launch_of(psutil.Process(copy)) == identity
        assert copy in {p.pid for p in processes_of(identity)}
        if ending == "stand-in killed":
            rank.kill()
        else:
            rank.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        out = (tmp_path / "out").read_text()
        # killed: sh reports 137; SIGTERM: the stand-in ends as its copy ended, by SIGTERM (143)
        assert out.endswith("status 137\n" if ending == "stand-in killed" else "status 143\n"), (ending, out)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(copy) and psutil.Process(copy).status() != psutil.STATUS_ZOMBIE \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not psutil.pid_exists(copy) or psutil.Process(copy).status() == psutil.STATUS_ZOMBIE, ending
        deadline = time.monotonic() + 10
        while copies_of(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert copies_of(server) == [], ending


def request(**changes) -> dict:
    import distlab

    env = dict(warm_start_environment())
    base = {"module": "distlab.rank.worker", "argv": ["-m"], "cwd": str(REPO), "env": env, "umask": 0o22,
            "affinity": sorted(os.sched_getaffinity(0)), "started": time.time(), "executable": sys.executable,
            "imports": [], "distlab": os.path.dirname(os.path.abspath(distlab.__file__)),
            "hash_seed": warm_start.hash_seed()}
    return {**base, **changes}


@pytest.fixture
def server_state(monkeypatch):
    """warm_checks' record of a server started under this process's environment."""
    monkeypatch.setattr(warm_checks, "environ_before_imports", dict(warm_start_environment()))
    monkeypatch.setattr(warm_checks, "hash_seed_of_server", ["random"])


@pytest.mark.parametrize("change, named", [
    ({"env": {"HF_HUB_OFFLINE": "0"}}, "HF_HUB_OFFLINE"),
    ({"env": {"PYTHONPATH": "/elsewhere"}}, "PYTHONPATH"),
    ({"env": {"MALLOC_ARENA_MAX": "2"}}, "MALLOC_ARENA_MAX"),
    ({"env": {"OPENBLAS_CORETYPE": "Haswell"}}, "OPENBLAS_CORETYPE"),
    ({"module": "os"}, "not an entry module"),
    ({"distlab": "/another/checkout/distlab"}, "another distlab checkout"),
    ({"executable": "/usr/bin/python-other"}, "another Python"),
    ({"imports": ["scipy"]}, "no flavour server imports ['scipy']"),
    ({"hash_seed": "7"}, "hash seed 7 (the server's is random): a forked interpreter cannot change its hash seed"),
])
def test_a_start_the_server_cannot_make_identical_to_a_fresh_one_is_refused(change, named, server_state):
    wanted = request()
    if "env" in change:
        wanted["env"] = {**wanted["env"], **change["env"]}
    else:
        wanted.update(change)
    assert named in warm_checks.refusal(wanted)
    assert warm_checks.refusal(request()) is None
    # per-launch settings are applied in the copy, not refused
    assert warm_checks.refusal(request(env={**request()["env"], "OMP_NUM_THREADS": "3", "RANK": "1",
                                           "TORCHELASTIC_RUN_ID": "x", "MKL_NUM_THREADS": "3",
                                           "OPENBLAS_NUM_THREADS": "2"})) is None


@pytest.mark.slow
@pytest.mark.parametrize("overrides, wanted", [
    ({"strategy": "ddp"}, ["mlflow"]),
    ({"strategy": "deepspeed", "deepspeed": {"zero_stage": 1}}, ["deepspeed", "mlflow"]),
    ({"strategy": "accelerate", "launcher": "accelerate", "method": "lora"}, ["accelerate", "peft", "mlflow"]),
    ({"strategy": "accelerate", "launcher": "accelerate", "method": "qlora"},
     ["accelerate", "peft", "bitsandbytes", "mlflow"]),
])
def test_a_flavour_server_imports_only_what_a_fresh_rank_of_that_spec_imports(overrides, wanted, prepared,
                                                                               tmp_path, monkeypatch):
    """A warm copy maps its server's modules: each flavour import, and each module every server
    preloads, must be one the fresh rank makes itself (Python's own import log, -X importtime, of
    a fresh 1-rank run)."""
    import re

    from tests.conftest import resolve, run_experiment

    spec = resolve(dict(overrides, world_size=1, tracking=["mlflow"]), steps=2, untimed_steps=1)
    assert warm_start.rank_imports(spec, 0) == wanted
    assert warm_start.rank_imports(spec, 1) == [name for name in wanted if name != "mlflow"]
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    # Python's import log misses importlib.import_module (transformers' lazy submodules, the Auto
    # classes' model code): a sitecustomize logs those calls too.
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import importlib, sys\n"
        "_import_module = importlib.import_module\n"
        "def import_module(name, package=None):\n"
        "    module = _import_module(name, package)\n"
        "    print(f'import_module: {module.__name__}', file=sys.stderr)\n"
        "    return module\n"
        "importlib.import_module = import_module\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), *sys.path]))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    run_experiment(prepared, tmp_path / "run", spec, checkpoint=False)
    log = (tmp_path / "run" / "train.log").read_text()
    imported = set(re.findall(r"^(?:import time:.*\||import_module:)\s+([\w.]+)$", log, re.M))
    assert {"torch", "transformers.models.llama.modeling_llama"} <= imported  # both logs are there
    assert set(wanted) <= imported, set(wanted) - imported
    not_imported = {"distlab.rank.worker", "distlab.rank.validate_ranks"}  # a rank runs one as __main__
    if spec["launcher"] != "torchrun":  # only torchrun's agent imports its launcher API
        not_imported.add("torch.distributed.launcher.api")
    assert set(PRELOAD) - not_imported <= imported, set(PRELOAD) - not_imported - imported


@pytest.mark.slow
def test_a_refused_start_runs_fresh_and_says_why(server, prepared, tmp_path, monkeypatch):
    from tests.conftest import resolve, run_experiment

    monkeypatch.setenv(warm_start.SOCKET_ENV, server)
    monkeypatch.setenv("HF_HUB_VERBOSITY", "error")  # read by huggingface_hub at import: not the server's
    record = run_experiment(prepared, tmp_path / "run", resolve({"world_size": 1}, steps=2, untimed_steps=1))
    assert record["timeline"]["start"] == ("fresh interpreter (warm start refused: HF_HUB_VERBOSITY differs "
                                           "('error'; the server imported under None))")
    assert "distlab warm start refused" in (tmp_path / "run" / "train.log").read_text()


def test_a_gpu_or_link_launch_is_never_offered_a_warm_start(monkeypatch):
    """A link's ranks run in host namespaces a copy of the server would not be in; nothing
    started there (nsenter) carries the socket (tests/test_links_warm.py runs one)."""
    from distlab.launchers.links import LinkedHosts
    from distlab.launchers.environment import rank_environment
    from tests.conftest import resolve

    monkeypatch.setenv(warm_start.SOCKET_ENV, "/some/socket")
    cpu = resolve({"world_size": 1})
    assert rank_environment(cpu)[warm_start.SOCKET_ENV] == "/some/socket"
    assert warm_start.SOCKET_ENV not in rank_environment(cpu.replace(device="cuda"))
    assert warm_start.SOCKET_ENV not in rank_environment(cpu.replace(link={"bandwidth_mbit": 100}))
    hosts = LinkedHosts(1)
    hosts.holders["host0"] = SimpleNamespace(pid=1234)  # inside() reads only the holder's pid
    command = hosts.inside(0, ["python"])
    assert command[:command.index("python")].count("-u") == 1
    assert command[command.index("-u") + 1] == warm_start.SOCKET_ENV


def test_a_server_that_never_answers_does_not_hang_the_rank(tmp_path, monkeypatch):
    """A stuck server (it accepts nothing) leaves the request in its backlog: the stand-in gives
    up after REPLY_TIMEOUT_S and starts fresh, saying why."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "socket"))
    listener.listen(1)
    monkeypatch.setattr(warm_start, "REPLY_TIMEOUT_S", 0.5)
    started = time.monotonic()
    reply, sock = warm_start._request(str(tmp_path / "socket"), "distlab.rank.worker", [])
    assert reply == {"refused": "the server did not answer in 0.5 s"} and sock is None
    assert time.monotonic() - started < 10
    reply, _ = warm_start._request(str(tmp_path / "nothing"), "distlab.rank.worker", [])
    assert reply["refused"].startswith(f"no server at {tmp_path / 'nothing'}")
    listener.close()


def test_a_stand_in_in_another_context_starts_fresh_and_the_server_says_why(server, tmp_path):
    """A rank started under other resource limits (as under `prlimit`, a job scheduler's
    ulimit) would run with the server's in a copy: it starts fresh, and both logs say why."""
    agent, _ = stand_in(server, tmp_path / "missing-job.json", "warmtest-5", tmp_path / "out",
                        prefix="prlimit --nofile=1000:1000 --")
    agent.wait(timeout=120)
    out = (tmp_path / "out").read_text()
    assert "distlab warm start refused, starting fresh: limit 'Max open files' differs ('1000 1000 files'" in out
    assert out.endswith("status 1\n") and "missing-job.json" in out, out  # the fresh start's own error
    assert "limit 'Max open files' differs" in server_log(server)


def waiting_for_reply(pid: int) -> bool:
    """Whether a stand-in sent its request and now waits for the server's reply: it holds a unix
    socket and sleeps in the kernel reading it (a socket with a timeout: in poll)."""
    try:
        waiting = Path(f"/proc/{pid}/wchan").read_text().startswith(("unix_stream", "poll_schedule_timeout"))
        return waiting and bool(psutil.Process(pid).net_connections(kind="unix"))
    except (OSError, psutil.Error):
        return False


def raw_request(path: str, message) -> "socket.socket":
    """A request as a stand-in sends it (with /dev/null as its stdio)."""
    import json
    import struct

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    body = json.dumps(message).encode()
    null = os.open(os.devnull, os.O_RDWR)
    try:
        socket.send_fds(sock, [struct.pack("!I", len(body)) + body], [null, null, null])
    finally:
        os.close(null)
    return sock


def test_one_bad_or_abandoned_request_never_ends_the_server(server, tmp_path):
    """While the server is busy (stopped here, as it is while it imports) requests queue: one
    without `module`, one whose stand-in closed its connection, one whose rank was killed while
    it waited. Each costs its own request only: the rank queued after them runs warm."""
    base = server_pid(server)
    os.kill(base, signal.SIGSTOP)
    try:
        shapeless = raw_request(server, {key: value for key, value in request().items() if key != "module"})
        raw_request(server, request(argv=["worker", "--job", str(tmp_path / "none.json")])).close()
        agent, rank = stand_in(server, tmp_path / "missing-job.json", "warmtest-6", tmp_path / "killed")
        deadline = time.monotonic() + 60
        while not waiting_for_reply(rank.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert waiting_for_reply(rank.pid)
        rank.kill()
        agent.wait(timeout=30)
        agent, rank = stand_in(server, tmp_path / "missing-job.json", "warmtest-7", tmp_path / "out")
        deadline = time.monotonic() + 60
        while not waiting_for_reply(rank.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os.kill(base, signal.SIGCONT)
    assert warm_start.read_message(shapeless) == {"refused": "request field 'module' is missing"}
    shapeless.close()
    agent.wait(timeout=60)
    out = (tmp_path / "out").read_text()
    assert out.endswith("status 1\n") and "Traceback" in out, out  # the copy's own error...
    assert "warm start" not in out, out  # ...from a copy: neither refused nor left by its server
    assert psutil.Process(base).status() != psutil.STATUS_ZOMBIE
    deadline = time.monotonic() + 10
    while copies_of(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert copies_of(server) == []  # the abandoned request's copy was killed and its record removed
    log = server_log(server)
    assert "BrokenPipeError" in log or "ConnectionResetError" in log, log[-3000:]


def test_every_cpu_experiment_of_the_default_run_is_offered_a_warm_start():
    """Each flavour a CPU rank of the default run asks for is one a flavour server imports: a QLoRA
    rank once asked for bitsandbytes, which no server imported, and started fresh every time."""
    from distlab.configuration.config import load_file
    from distlab.launchers.warm_start import flavours

    _, specs = load_file("config/config.yaml", gpu_count=0)
    for name, spec in specs.items():
        for rank in range(spec["world_size"]):
            for training in (True, False):
                asked = set(warm_start.rank_imports(spec, rank, training))
                assert asked <= set(flavours()), (name, rank, asked - set(flavours()))
