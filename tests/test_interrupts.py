"""Ctrl-C / SIGTERM reach a command blocked reading a FIFO whatever moment they land at (criticalkv.interrupts,
criticalkv.files.read_text_interruptibly). Each case runs in its own small Python process (no torch), reading
a FIFO that no writer ever opens: a plain ``read()`` would block there for ever."""

import os
import subprocess
import sys
import textwrap

import pytest

from criticalkv.files import read_text_interruptibly

CASES = {
    # the signal is handled by another thread: Python's C handler notes it, the main thread is already blocked
    # in the read and is not interrupted (what happens when a signal lands just before the blocking call)
    "noted while blocked": """
        import threading, time
        def kill_me():
            time.sleep(0.3)
            signal.pthread_kill(threading.get_ident(), SIG)  # to this helper thread, not the main one
        threading.Thread(target=kill_me).start()
    """,
    # the handler's exception is raised inside a __del__ and dropped by Python ("Exception ignored in")
    "raised in a __del__": """
        class Dropper:
            def __del__(self):
                signal.raise_signal(SIG)
        Dropper()
    """,
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sig, exception", [("SIGINT", "KeyboardInterrupt"), ("SIGTERM", "Terminated")])
def test_a_signal_ends_a_blocked_read(tmp_path, case, sig, exception):
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    program = textwrap.dedent("""
        import signal, sys
        from criticalkv.files import read_text_interruptibly
        from criticalkv.interrupts import Terminated, signals_raise
        SIG = signal.{sig}
        with signals_raise():
            try:
                {case}
                read_text_interruptibly(sys.argv[1])
            except (KeyboardInterrupt, Terminated) as err:
                print(type(err).__name__)
    """).format(sig=sig, case=textwrap.indent(textwrap.dedent(CASES[case]), " " * 8).strip())
    run = subprocess.run([sys.executable, "-c", program, str(fifo)], capture_output=True, text=True, timeout=30)
    assert run.stdout.strip() == exception, (run.stdout, run.stderr)


def test_fifo_and_regular_file_read_the_same_text(tmp_path):
    text = "line one\r\nline two € 日本\rend\n"
    regular = tmp_path / "prompt.txt"
    regular.write_bytes(text.encode())
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    writer = subprocess.Popen([sys.executable, "-c", f"import sys, time; time.sleep(0.3); "
                               f"open(sys.argv[1], 'wb').write({text.encode()!r})", str(fifo)])
    assert read_text_interruptibly(fifo) == read_text_interruptibly(regular) == regular.read_text(encoding="utf-8")
    assert writer.wait(30) == 0
