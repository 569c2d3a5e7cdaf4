"""A watchdog that outlives the process that started it only to clean up after it.

Why: ``tritonserver`` gets SIGKILL when its launcher dies (``prctl(PR_SET_PDEATHSIG)``), but its Python-backend
stubs are *its* children, and a stub cleans up on its own when its server is gone only when nothing is in flight:
with responses streaming its exit path can block for ever (python_backend's ``pb_stub.cc``: on its parent's death
the health thread joins the stub's message-queue threads and destroys its Python objects under the GIL, while a
send to the dead server retries until its queue has room; SIGINT and SIGTERM are ignored there). Seen: a 2.2 GB stub
left under PID 1, ignoring SIGTERM, its ``/dev/shm`` region and the temporary repository left behind (2 of 3
SIGKILLs of a launcher with four streams running, tests/serving/test_shutdown.py's load). The stubs stay in the process group of the ``tritonserver`` that forked them, so killing that group ends
every process of the server, whatever each one is doing.

``Watchdog()`` starts this file as a small stdlib-only process (``python -I -S``: no site-packages, ~20 ms, a few
MB) in its own session, so a Ctrl-C or SIGHUP sent to the launcher's terminal never reaches it. Its standard input
is the read end of a pipe whose only write end the launcher holds; the launcher writes what to clean up, one line
each:

    group <pgid>        SIGKILL this process group
    pid <pid> <start>   SIGKILL this process if it is still the one that started at <start> (field 22 of
                        /proc/<pid>/stat: a number the kernel reuses never names another process here)
    shm <prefix>        remove /dev/shm/<prefix>* (the shared-memory regions the server names with this prefix)
    remove <path>       remove this file or directory tree
    done                the launcher cleaned up itself: exit without doing anything

When the pipe reaches end of file without ``done`` (the launcher died: SIGKILL, the OOM killer, a crash), the
kernel has closed the launcher's write end, and the watchdog kills the groups, waits until they are gone (at most
``GROUP_WAIT_S``), removes the shared-memory regions and the paths, says so on its standard error, and exits.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

#: how long the watchdog waits for a killed process group to disappear before it removes the files anyway
GROUP_WAIT_S = 10.0
SHM_DIR = "/dev/shm"


class Watchdog:
    """The launcher's side: starts the watchdog process and tells it what to clean up if this process dies.

    Every method writes one line; nothing is done while this process lives. ``close()`` (this process cleaned up
    itself) lets the watchdog exit without doing anything. Call it from the main thread of a process on Linux.
    """

    def __init__(self, name: str = "criticalkv"):
        read, self._write = os.pipe()  # both ends non-inheritable: no child but the watchdog gets the read end
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), name, str(os.getpid())],
                stdin=read, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)

    def _send(self, line: str) -> None:
        if self._write is None:
            raise RuntimeError("the watchdog is closed")
        if "\n" in line:
            raise ValueError(f"a watchdog line cannot hold a newline: {line!r}")
        os.write(self._write, (line + "\n").encode())

    def kill_group(self, pgid: int) -> None:
        self._send(f"group {int(pgid)}")

    def kill_process(self, pid: int) -> bool:
        """SIGKILL process ``pid`` (as it is now: its start time is sent along) if this process dies; False if it is
        already gone."""
        start = start_time(pid)
        if start is None:
            return False
        self._send(f"pid {int(pid)} {start}")
        return True

    def remove_shm(self, prefix: str) -> None:
        if "/" in prefix or not prefix:
            raise ValueError(f"not a shared-memory name prefix: {prefix!r}")
        self._send(f"shm {prefix}")

    def remove(self, path) -> None:
        self._send(f"remove {os.path.abspath(path)}")

    def close(self, timeout_s: float = 10.0) -> None:
        """This process cleaned up itself: the watchdog exits without doing anything."""
        if self._write is None:
            return
        try:
            os.write(self._write, b"done\n")
        finally:
            os.close(self._write)
            self._write = None
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ------------------------------------------------------------------------------------------------ the process
def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's field 22), or None if there is none."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # the fields after the command (which may hold spaces and ")")


def kill_processes(processes: list[tuple[int, str]], log) -> int:
    """SIGKILL each (pid, start time) still running as that process; how many were."""
    killed = 0
    for pid, start in processes:
        if start_time(pid) != start:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    if killed:
        log(f"killed {killed} process(es) it started")
    return killed


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number: not ours any more
        return False
    return True


def clean_up(groups: list[int], shm_prefixes: list[str], paths: list[str], log) -> None:
    """SIGKILL the groups, wait for them to go, then remove the shared-memory regions and the paths."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
            log(f"killed process group {pgid} (tritonserver and its model processes)")
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + GROUP_WAIT_S
    while any(_group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    for prefix in shm_prefixes:
        for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
            try:
                os.unlink(path)
                log(f"removed {path}")
            except FileNotFoundError:
                pass
            except OSError as err:
                log(f"could not remove {path}: {err.strerror}")
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
        else:
            continue
        log(f"removed {path}")


def main(argv: list[str]) -> int:
    name, owner = argv[0], argv[1]
    # its own session already keeps the terminal's signals away; these make sure a stray one does not stop it either
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    groups: list[int] = []
    processes: list[tuple[int, str]] = []
    shm_prefixes: list[str] = []
    paths: list[str] = []
    stdin = os.fdopen(0, "rb", buffering=0)
    pending = b""
    while True:
        try:
            data = stdin.read(4096)
        except InterruptedError:
            continue
        if not data:
            break  # end of file: the owner closed the pipe (or died)
        pending += data
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            word, _, rest = raw.decode(errors="replace").partition(" ")
            if word == "done":
                return 0
            if word == "group":
                groups.append(int(rest))
            elif word == "pid":
                pid, start = rest.split()
                processes.append((int(pid), start))
            elif word == "shm":
                shm_prefixes.append(rest)
            elif word == "remove":
                paths.append(rest)

    def log(message: str) -> None:
        try:
            print(f"{name}: {message}", file=sys.stderr, flush=True)
        except OSError:  # nobody reads our standard error any more
            pass

    if groups or processes or shm_prefixes or paths:
        log(f"process {owner} ended without stopping its server: cleaning up after it")
        kill_processes(processes, log)
        clean_up(groups, shm_prefixes, paths, log)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
