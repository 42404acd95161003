"""Opening a store: what it refuses, what it never touches, and damage that must not kill the process."""

import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import multiprocessing as mp
import os
import pwd
import shutil
import stat
import subprocess
import sys
import warnings

import mlx.core as mx
import pytest

from segcache.errors import StoreError, StoreWarning
from segcache.store import Record, open_store
from segcache.store import cli

PY = [sys.executable, "-c"]
SRC = os.path.dirname(os.path.dirname(segcache.__file__))  # children import the segcache under test
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


def rec(i: int, n: int = 64) -> Record:
    return Record("kv", n, {"k": mx.arange(i, i + n * 32, dtype=mx.float32)}, {"i": i}, cost=0.1)


def snapshot(path) -> dict:
    """Names, sizes and modes of everything under path (to prove nothing was touched)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(root, n)
            st = os.lstat(p)
            out[os.path.relpath(p, path)] = (st.st_size, stat.S_IMODE(st.st_mode))
    out["."] = stat.S_IMODE(os.stat(path).st_mode)
    return out


def make_store(path, n=40):
    with open_store(path, ram_bytes=0, disk_bytes=1 << 28) as s:
        for i in range(n):
            s.put(b"k%d" % i, rec(i))


# -- defect 2: inspection never creates, open never chmods what it did not create


@pytest.mark.parametrize("cmd", ["stats", "ls", "verify"])
def test_inspection_of_a_users_directory_changes_nothing(tmp_path, capsys, cmd):
    notes = tmp_path / "notes"
    notes.mkdir(mode=0o755)
    os.chmod(notes, 0o755)
    (notes / "todo.txt").write_text("buy milk\n")
    before = snapshot(notes)
    assert cli.main([cmd, str(notes)]) == 1
    assert f"no store at {notes}" in capsys.readouterr().err
    assert snapshot(notes) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([cmd, str(empty)]) == 1 and os.listdir(empty) == []
    assert cli.main([cmd, str(tmp_path / "missing")]) == 1 and not (tmp_path / "missing").exists()
    assert cli.main(["gc", str(empty), "--max-bytes", "0"]) == 1 and os.listdir(empty) == []


def test_create_false_creates_nothing(tmp_path):
    with pytest.raises(StoreError, match="no store at"):
        open_store(tmp_path / "new", create=False)
    assert not (tmp_path / "new").exists()


def test_existing_directory_keeps_its_mode_and_warns_when_others_can_read(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o755)
    with pytest.warns(StoreWarning, match="accessible to other users"):
        open_store(d, ram_bytes=0, disk_bytes=1 << 26).close()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        open_store(private, ram_bytes=0, disk_bytes=1 << 26).close()
    fresh = tmp_path / "a" / "b"
    open_store(fresh, ram_bytes=0, disk_bytes=1 << 26).close()
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700  # created by the store: private


def test_non_empty_directory_without_a_store_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(StoreError, match="not empty and holds no segcache store"):
        open_store(tmp_path)
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    os.chown(d, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(StoreError, match="owned by uid"):
        open_store(d)
    assert os.listdir(d) == []


def test_a_file_as_path_and_a_double_open_are_store_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        open_store(f)
    with open_store(tmp_path / "s", ram_bytes=0, disk_bytes=1 << 26):
        with pytest.raises(StoreError, match="already open in this process"):
            open_store(tmp_path / "s", ram_bytes=0, disk_bytes=1 << 26)


# -- defect 9: a cut-short data.mdb and a full file system become "no store", never SIGBUS

OPEN_AND_READ = r"""
import sys
from segcache.errors import StoreError
from segcache.store import open_store
try:
    with open_store(sys.argv[1], ram_bytes=0, disk_bytes=1 << 28) as s:
        print("opened", s.stats()["entries"], [s.get(b"k%d" % i) is not None for i in range(40)].count(True))
except StoreError as e:
    print("StoreError:", e)
"""


@pytest.mark.parametrize("keep", [0.5, 0.9, 4096 + 100])
def test_cut_short_data_file_is_no_store_not_sigbus(tmp_path, keep):
    make_store(tmp_path / "s")
    data = tmp_path / "s" / "data.mdb"
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(int(size * keep) if keep < 1 else keep)
    got = subprocess.run(PY + [OPEN_AND_READ, str(tmp_path / "s")], capture_output=True, text=True, timeout=120, env=ENV)
    assert got.returncode == 0, f"child died with {got.returncode}: {got.stderr[-2000:]}"
    assert "StoreError: no store at" in got.stdout and "cut short" in got.stdout, got.stdout
    verify = subprocess.run([sys.executable, "-m", "segcache.cli", "store", "verify", str(tmp_path / "s")],
                            capture_output=True, text=True, timeout=120, env=ENV)
    assert verify.returncode == 1 and "no store at" in verify.stderr, (verify.returncode, verify.stderr[-2000:])


def test_damaged_meta_pages_are_no_store(tmp_path):
    make_store(tmp_path / "s", n=3)
    with open(tmp_path / "s" / "data.mdb", "r+b") as f:
        f.seek(16)
        f.write(b"\0\0\0\0")
    with pytest.raises(StoreError, match="meta page 0 is damaged"):
        open_store(tmp_path / "s")


@pytest.fixture
def full_fs(tmp_path):
    """A 1 MiB tmpfs filled to the last byte (root only)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not permitted'}); the full-disk case needs one")
    try:
        fd = os.open(mnt / "fill", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass  # ENOSPC: full
        finally:
            os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_new_store_on_a_full_file_system_is_no_store_not_sigbus(full_fs):
    got = subprocess.run(PY + [OPEN_AND_READ, str(full_fs / "store")], capture_output=True, text=True, timeout=120, env=ENV)
    assert got.returncode == 0, f"child died with {got.returncode}: {got.stderr[-2000:]}"
    assert "StoreError: no store at" in got.stdout and "file system is full" in got.stdout, got.stdout


def test_generate_goes_on_without_a_damaged_store(tmp_path):
    from test_generate_cli import write_model

    model = write_model(tmp_path / "m", "llama", 0)
    make_store(tmp_path / "s", n=3)
    base = [sys.executable, "-m", "segcache.cli", "generate", "--model", model, "--prompt", "def f(", "-m", "5", "--ignore-chat-template",
            "--verbose", "False"]  # the text only (verbose, the default as in mlx_lm.generate, adds timings)
    with open(tmp_path / "s" / "data.mdb", "r+b") as f:
        f.truncate(9000)
    # both runs at once (the plain one reads no store): their start-ups overlap
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
            for argv in (base, base + ["--prompt-cache-dir", str(tmp_path / "s")])]
    try:
        plain, got = [subprocess.CompletedProcess(p.args, 0, *p.communicate(timeout=300)) for p in runs]
        plain.returncode, got.returncode = (p.returncode for p in runs)
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == plain.stdout
    assert "StoreWarning" in got.stderr and "generating without the prompt cache" in got.stderr


# -- defect 11: reader slots of dead processes


def _die_in_read_txn(path: str, max_readers: int) -> None:
    s = open_store(path, ram_bytes=0, disk_bytes=1 << 28, max_readers=max_readers)
    txn = s._disk.env.begin()
    txn.get(b"k0", db=s._disk.records)
    os._exit(0)  # dies holding its reader slot


def _open_and_stat(path: str, max_readers: int, out) -> None:
    with open_store(path, ram_bytes=0, disk_bytes=1 << 28, max_readers=max_readers) as s:
        out.put(s.stats()["disk_entries"])


def test_reader_slots_of_dead_processes_are_reclaimed(tmp_path):
    """While one process keeps the store open (a server), dead readers' slots must come back."""
    readers = 4  # LMDB sizes the reader table when it creates lock.mdb
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 28, max_readers=readers) as s:
        for i in range(3):
            s.put(b"k%d" % i, rec(i))
    ctx = mp.get_context("spawn")
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 28, max_readers=readers) as s:
        for _ in range(readers):
            p = ctx.Process(target=_die_in_read_txn, args=(str(tmp_path), readers))
            p.start()
            p.join(timeout=120)
            assert p.exitcode == 0
        assert s.stats()["disk_entries"] == 3  # every slot is held by a dead process here
        assert s.verify()["corrupt"] == 0
        q = ctx.Queue()
        p = ctx.Process(target=_open_and_stat, args=(str(tmp_path), readers, q))
        p.start()
        p.join(timeout=120)
        assert p.exitcode == 0 and q.get(timeout=10) == 3


# -- defect 12


def test_reopening_with_a_smaller_budget_evicts_at_open_and_keeps_writing(tmp_path):
    make_store(tmp_path, n=40)
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 28) as s:
        big = s.stats()["disk_bytes"]
    small = big // 4
    with open_store(tmp_path, ram_bytes=0, disk_bytes=small) as s:
        assert s.stats()["disk_bytes"] <= small
        s.check()
        for i in range(100, 140):  # writes keep landing on disk
            s.put(b"k%d" % i, rec(i))
        assert s.get(b"k139") is not None and s._disk.contains(b"k139")
        s.check()


def test_other_page_tokens_or_salt_warn(tmp_path):
    open_store(tmp_path, page_tokens=16, salt="a").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        open_store(tmp_path, page_tokens=16, salt="a").close()
        open_store(tmp_path, create=False).close()  # inspection does not know the writer's parameters
    with pytest.warns(StoreWarning, match="page_tokens 16"):
        open_store(tmp_path, page_tokens=32, salt="a").close()
    with pytest.warns(StoreWarning, match="salt"):
        open_store(tmp_path, page_tokens=16, salt="b").close()
    open_store(tmp_path / "t", salt="tenant-secret-7").close()
    assert b"tenant-secret-7" not in (tmp_path / "t" / "data.mdb").read_bytes()  # kept as a hash


def test_cli_gc_rejects_negative_and_store_help_works(tmp_path, capsys):
    make_store(tmp_path, n=5)
    with pytest.raises(SystemExit) as e:
        cli.main(["gc", str(tmp_path), "--max-bytes", "-5"])
    assert e.value.code == 2 and "negative" in capsys.readouterr().err
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 28, create=False) as s:
        assert s.stats()["disk_entries"] == 5
    with pytest.raises(StoreError, match="max_bytes >= 0"):
        with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 28) as s:
            s.gc(-1)
    for argv in (["store", "--help"], ["store", "stats", "--help"], ["store", "gc", "--help"]):
        r = subprocess.run([sys.executable, "-m", "segcache.cli", *argv], capture_output=True, text=True, timeout=120, env=ENV)
        assert r.returncode == 0 and "usage: segcache store" in r.stdout, (argv, r.stderr[-500:])


def test_lmdb_failures_surface_as_one_line_cli_errors(tmp_path):
    make_store(tmp_path / "s", n=2)
    with open(tmp_path / "s" / "data.mdb", "r+b") as f:
        f.truncate(5000)
    r = subprocess.run([sys.executable, "-m", "segcache.cli", "store", "stats", str(tmp_path / "s")], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    shutil.rmtree(tmp_path / "s")


def test_a_read_only_file_system_is_a_store_error(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not permitted'})")
    try:
        os.chmod(mnt, 0o700)
        make_store(mnt / "s", n=2)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(StoreError, match="cannot open the prefix store"):
            open_store(mnt / "s")
        assert cli.main(["stats", str(mnt / "s")]) == 1
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
