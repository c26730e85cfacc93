"""Errors are printed once, short, with the user's line; a script that needs several
processes, started with plain ``python``, says how to launch it."""

import subprocess
import sys


def test_an_error_raised_on_every_rank_is_printed_once(modelparallel, script):
    path = script("""
        import modelparallel as mp
        mp.init({"tensor_parallel_degree": 3})
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, path, timeout=200)
    assert ran.code == 1, ran.all
    lines = [line for line in ran.all.splitlines() if line.strip()]
    assert len(lines) <= 25, ran.all
    assert ran.all.count("does not divide the world size 2") == 1, ran.all
    assert "error: ConfigError: invalid modelparallel configuration:" in ran.err
    assert f"in your code: {path}:3: mp.init(" in ran.err, ran.err
    assert "Traceback" not in ran.all and "Sending process" not in ran.all, ran.all
    assert ran.seconds < 120, ran.seconds  # generous: two ranks start on a loaded machine


def test_plain_python_on_a_script_that_needs_four_ranks_names_the_launcher(script,
                                                                            clean_env):
    path = script("""
        import modelparallel as mp
        mp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2})
    """, name="needs4.py")
    ran = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         env=clean_env, timeout=120)
    assert ran.returncode == 1
    assert "the configuration needs 4 (or a multiple): run `modelparallel run " \
           "--nproc-per-node 4 needs4.py`" in ran.stderr, ran.stderr
