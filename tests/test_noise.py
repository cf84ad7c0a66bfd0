"""The machine's noise while steps are timed (distlab.runtime.noise): other processes' CPU time is
measured from /proc/stat, not guessed, and a run that had to share its cores says so."""
import subprocess
import sys
import time

from distlab.runtime.noise import NoiseProbe, machine_cores, summarize_noise


def test_other_processes_cpu_during_the_window_marks_the_run_busy():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(machine_cores() + 1)]
    try:
        time.sleep(0.3)  # the hogs are running before the window opens
        probe = NoiseProbe()
        probe.start()
        end = time.perf_counter() + 1.5
        while time.perf_counter() < end:  # this "rank" computes on one core
            pass
        record = probe.stop()
    finally:
        for hog in hogs:
            hog.kill()
    noise = summarize_noise([record], job_cores=1)
    # The hogs took most of the machine: more than the cores a 1-core run left free.
    assert noise["busy"] and noise["others_cores"] > noise["free_cores"], noise
    assert noise["ranks_cpu_s"] < 1.5 and len(noise["load_avg_1min"]) == 2
