"""Damaged checkpoints and failed saves, as a user meets them: a truncated file is named
as damaged and skipped by ``newest()``; a save that fills the disk leaves nothing behind.
Each case is a real script in a process of its own (a world of one)."""

import shutil
import subprocess
import sys
import textwrap

import pytest

SAVE = """
    import sys, torch, modelparallel as mp
    mp.init({"hybrid_shard_degree": 0})
    torch.manual_seed(0)
    model = mp.shard(torch.nn.Sequential(torch.nn.Linear(4, WIDTH), torch.nn.Linear(WIDTH, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def python(tmp_path, env, body: str, *args: str, prefix: tuple[str, ...] = (), width: int = 8):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SAVE).replace("WIDTH", str(width)) +
                      textwrap.dedent(body))
    return subprocess.run([*prefix, sys.executable, str(script), *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.timeout(240)
def test_truncated_checkpoint_is_named_damaged_and_newest_skips_it(tmp_path, clean_env):
    ckpt = tmp_path / "ckpt"
    saved = python(tmp_path, clean_env, """
        for step in (1, 2):
            mp.save_checkpoint(sys.argv[1], f"step{step}", model=model, optimizer=optimizer)
    """, str(ckpt))
    assert saved.returncode == 0, saved.stderr
    shard = ckpt / "step2" / "sharded" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # what a copy cut short leaves
        f.truncate(size // 2)

    resumed = python(tmp_path, clean_env, """
        tag = mp.checkpoint.newest(sys.argv[1])
        print("newest:", tag)
        mp.resume_from_checkpoint(sys.argv[1], tag=tag, model=model, optimizer=optimizer)
        print("resumed")
        try:
            mp.resume_from_checkpoint(sys.argv[1], tag="step2", model=model)
        except mp.checkpoint.CheckpointError as e:
            print("error:", e)
    """, str(ckpt))
    assert resumed.returncode == 0, resumed.stderr
    assert "newest: step1\nresumed\n" in resumed.stdout
    damaged = [line for line in resumed.stderr.splitlines() if "damaged" in line]
    assert damaged == [f"checkpoint {ckpt}/step2 is damaged (its file "
                       f"sharded/__0_0.distcp is {size // 2} bytes, {size} when it was "
                       f"saved); using {ckpt}/step1, the newest intact one"], resumed.stderr
    error = resumed.stdout.split("error: ", 1)[1].strip()
    assert error == (f"checkpoint {ckpt}/step2 is damaged: its file sharded/__0_0.distcp is "
                     f"{size // 2} bytes, {size} when it was saved; resume from a complete "
                     f"one (['step1']) with tag=, or remove it")


def mounts_tmpfs() -> bool:
    """Whether this machine lets a process mount a tmpfs of its own (user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("api", ["save_checkpoint", "checkpoint.save"])
def test_save_that_fills_the_disk_leaves_no_temporary_files(tmp_path, clean_env, api):
    if not mounts_tmpfs():
        pytest.skip("cannot mount a small tmpfs here (no user namespaces)")
    disk = tmp_path / "disk"
    disk.mkdir()
    # a 256 KiB disk of its own (seen by this process only) and a 1 MiB model
    save = ('mp.save_checkpoint(root, "step1", model=model, optimizer=optimizer)'
            if api == "save_checkpoint" else
            'mp.checkpoint.save({"model": model.state_dict()}, checkpoint_id=root + "/step1")')
    ran = python(tmp_path, clean_env, f"""
        import os, subprocess
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", sys.argv[1]],
                       check=True)
        root = sys.argv[1] + "/ckpt"
        try:
            {save}
        except mp.checkpoint.CheckpointError as e:
            print("error:", e)
        print("left:", sorted(os.listdir(root)))
    """, str(disk), width=65536, prefix=("unshare", "--user", "--map-root-user", "--mount"))
    assert ran.returncode == 0, ran.stderr
    assert "No space left on device" in ran.stdout, ran.stdout
    assert "left: []" in ran.stdout, ran.stdout
