"""No process distlab starts outlives its job: timeouts, a SIGKILLed snakemake, reruns."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import REPO, resolve

from distlab.records.job import Job, ValidationJob
from distlab.records.spec import Spec


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def naming(marker: str) -> list[psutil.Process]:
    """The test's own bookkeeping (never the product's): live processes whose command line
    mentions marker (the test's temp folder)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and proc.status() != psutil.STATUS_ZOMBIE and \
                    any(marker in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def survivors(marker: str) -> list[str]:
    """Live processes (not zombies) whose command line mentions marker."""
    return [f"{p.pid}: {' '.join(p.info['cmdline'])[:160]}" for p in naming(marker)]


@pytest.fixture
def reaper(tmp_path):
    """Whatever the test leaves behind under tmp_path is killed afterwards (a failing test
    must not leave ranks training on a shared machine)."""
    yield
    for proc in naming(str(tmp_path)):
        proc.kill()


def start_snakemake(workdir) -> subprocess.Popen:
    """`snakemake --cores 2` on workdir/Snakefile, in the background."""
    return subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", "-d", str(workdir),
                             "-s", str(workdir / "Snakefile")], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def python_process(code: str) -> subprocess.Popen:
    """`python -c code` in the background, importing this checkout's distlab."""
    return subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)))


def wait_for_ranks(parent: subprocess.Popen, marker: str, module: str, log=None, count: int = 2) -> None:
    """Until `count` ranks of `module` (not their launcher) naming marker run, while parent does."""
    deadline = time.monotonic() + 240
    while len([p for p in survivors(marker) if module in p and "loopback" not in p]) < count:
        assert parent.poll() is None, log.read_text() if log else "the process starting the ranks ended"
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)


def sigkill_leaves_nothing(smk: subprocess.Popen, workdir) -> None:
    """SIGKILL snakemake (no cleanup can run); within 30 s nothing naming workdir is left running."""
    smk.send_signal(signal.SIGKILL)
    smk.wait()
    deadline = time.monotonic() + 30
    while survivors(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not survivors(str(workdir))


@pytest.mark.slow
def test_a_timeout_kills_every_rank_of_the_launch(tmp_path, reaper, monkeypatch):
    from distlab.launchers.ranks import start_ranks

    # Ranks that never end and never ask to die with their parent: only killing the tree
    # reaches them (torchrun starts each in its own session).
    (tmp_path / "sleepy_rank.py").write_text(textwrap.dedent("""
        import os, pathlib, sys, time
        pathlib.Path(sys.argv[-1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
        time.sleep(600)
    """))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}")
    spec = Spec({"world_size": 2, "device": "cpu", "cpu_threads_per_rank": 1, "launcher": "torchrun"})
    with pytest.raises(RuntimeError, match="sleepy ranks were killed with their launcher after the 20 s timeout"):
        start_ranks(spec, "sleepy_rank", [str(tmp_path)], tmp_path / "job.json", str(tmp_path / "launch.log"),
                    timeout=20, what="sleepy ranks")
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]  # both ranks had started
    time.sleep(0.5)
    assert not [pid for pid in pids if alive(pid)]
    assert not survivors(str(tmp_path))


def test_training_validation_and_the_collective_benchmark_start_ranks_through_one_service(tmp_path, monkeypatch):
    """Every set of ranks started on this machine goes through distlab.launchers.ranks, so the
    same rules hold for each: rendezvous on loopback, threads per rank, no GPU for CPU ranks,
    the launch identity (marker) on the command line, process handling by run_ranks."""
    from distlab.tools import collectives
    from distlab.jobs import validate
    from distlab.launchers import get_launcher, ranks

    started = []
    monkeypatch.setattr(ranks, "run_ranks", lambda cmd, env, log_path, timeout, marker=None, what=None, check=True:
                        started.append((cmd, env, marker, what, check)) or 0)
    accelerate = resolve({"world_size": 2, "strategy": "accelerate"}, stage="accelerate")
    for spec in (resolve({"world_size": 2}), accelerate):
        get_launcher(spec["launcher"])(Job(spec=spec, run_dir=str(tmp_path)), str(tmp_path / "job.json"), None,
                                       None)
    validate._run_phase(ValidationJob(spec=accelerate, plan=[["same", 2]], run_dir=str(tmp_path / "machine" / "run")),
                        tmp_path / "phase", None, 60)
    collectives.run_benchmark(collectives.plan({"world_size": 2, "min_bytes": 1024, "max_bytes_cpu": 1024,
                                                "max_bytes_cuda": 1024, "factor": 4, "iters": 1, "warmup": 1},
                                               {"a": accelerate}, 0), str(tmp_path / "out" / "collectives.json"), "box")
    assert [(what, check) for *_, what, check in started] == [
        ("training ranks", True), ("training ranks", True), ("validation ranks", False),  # its ranks' record decides
        ("collective benchmark ranks", True)]
    assert "accelerate.commands.launch" in started[1][0] and "accelerate.commands.launch" in started[2][0]
    for cmd, env, marker, _, _ in started:
        assert cmd[1:4] == ["-m", "distlab.launchers.entry", "distlab.launchers.loopback"] and env["GLOO_SOCKET_IFNAME"]
        assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
        assert marker in cmd


@pytest.mark.slow
def test_sigkill_of_snakemake_leaves_no_launcher_or_rank_running(prepared, tmp_path, reaper):
    spec = resolve({"world_size": 2}, steps=100000, untimed_steps=2)  # would train for an hour
    run_dir = tmp_path / "run"
    job = Job(spec=spec, run_dir=str(run_dir), data_dir=str(prepared / "data32"),
              model_source=str(prepared / "model"), hardware_json=str(prepared / "hardware.json"),
              env_allowlist=[], checkpoint_dir=None)
    job.write(tmp_path / "job-input.json")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        from distlab.records.job import read_job
        from distlab.jobs.launch import launch
        from distlab.jobs.rule_log import logged
        with logged(snakemake):
            launch(read_job(snakemake.input[0]))
    """))
    (tmp_path / "Snakefile").write_text(textwrap.dedent("""
        rule train:
            input: "job-input.json"
            output: "run/metrics.json"
            log: "train.log"
            script: "train.py"
    """))
    smk = start_snakemake(tmp_path)
    wait_for_ranks(smk, str((run_dir / "job.json").resolve()), "distlab.rank.worker", tmp_path / "train.log")
    assert (run_dir / "steps.jsonl").exists() is False  # mid-run, nothing finished
    sigkill_leaves_nothing(smk, tmp_path)


@pytest.mark.slow
def test_sigkill_of_snakemake_leaves_no_collective_benchmark_rank_running(tmp_path, reaper):
    """Rule collectives' script starts its ranks as training does (distlab.launchers.ranks): a
    SIGKILLed snakemake takes the script, torchrun and the benchmark's ranks down with it."""
    plan = {"world_size": 2, "device": "cpu", "gpus": 0, "nccl_skipped": None, "min_bytes": 1024,
            "max_bytes": 1024, "factor": 4, "iters": 10**8, "warmup": 1}  # would run for hours
    (tmp_path / "Snakefile").write_text(textwrap.dedent(f"""
        rule collectives:
            output: "{tmp_path}/out/collectives.json"  # absolute: the ranks' command lines name tmp_path
            params: plan={plan!r}, machine="testbox"
            log: "collectives.log"
            script: "{REPO}/scripts/collectives.py"
    """))
    smk = start_snakemake(tmp_path)
    wait_for_ranks(smk, str(tmp_path), "distlab.tools.collectives", tmp_path / "collectives.log")
    sigkill_leaves_nothing(smk, tmp_path)
    assert not (tmp_path / "out" / "collectives.json").exists()


@pytest.mark.slow
def test_a_second_launch_refuses_while_processes_of_the_first_still_run(tmp_path, reaper):
    from distlab.jobs.launch import job_file, launch
    from distlab.launchers.process import LAUNCH_ENV, new_launch_identity

    spec = resolve({})
    job = Job(spec=spec, run_dir=str(tmp_path / "run"))
    # An orphan of an earlier launch of this run: it carries that launch's identity.
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(tmp_path)],
                              env=dict(os.environ, **{LAUNCH_ENV: new_launch_identity(job_file(job.run_dir))}))
    try:
        time.sleep(0.2)
        with pytest.raises(RuntimeError, match=rf"still run .*kill {orphan.pid}"):
            launch(job)
        assert not (tmp_path / "run" / "job.json").exists()  # refused before writing anything
    finally:
        orphan.kill()
        orphan.wait()


@pytest.mark.slow
def test_a_process_that_only_names_the_job_file_neither_blocks_a_launch_nor_dies_with_it(tmp_path, reaper):
    """`tail -f .../job.json` is not a rank: processes are matched by the identity every process
    of a launch inherits, not by a substring of their command line."""
    from distlab.jobs.launch import job_file
    from distlab.launchers.process import refuse_if_running, run_tree

    job_path = job_file(str(tmp_path / "run"))
    reader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", job_path])
    try:
        time.sleep(0.2)
        refuse_if_running(job_path, "experiment x")  # not refused
        assert run_tree([sys.executable, "-c", "pass"], dict(os.environ), None, 60, marker=job_path) == 0
        assert alive(reader.pid)  # the launch's clean-up left it alone
    finally:
        reader.kill()
        reader.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_another_users_process_with_the_launch_identity_neither_blocks_a_launch_nor_dies_with_it(tmp_path, reaper):
    """Anybody may set DISTLAB_LAUNCH on a process of their own (the identity is a hash of the job
    file's path): when distlab runs as root, another user's process is never taken for a rank."""
    from distlab.jobs.launch import job_file
    from distlab.launchers.process import LAUNCH_ENV, kill_tree, new_launch_identity, processes_of, \
        refuse_if_running, run_key

    job_path = job_file(str(tmp_path / "run"))
    identity = new_launch_identity(job_path)
    stranger = subprocess.Popen(["sleep", "120"], user=65534, group=65534,
                                env=dict(os.environ, **{LAUNCH_ENV: identity}))
    mine = subprocess.Popen(["sleep", "120"], env=dict(os.environ, **{LAUNCH_ENV: identity}))
    try:
        time.sleep(0.2)
        assert [p.pid for p in processes_of(run_key(job_path))] == [mine.pid]  # this user's orphan still counts
        mine.kill()
        mine.wait()
        refuse_if_running(job_path, "experiment x")  # not refused
        kill_tree(None, identity)
        assert alive(stranger.pid)  # the launch's clean-up left it alone
    finally:
        stranger.kill()
        stranger.wait()
