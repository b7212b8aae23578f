"""Loaded by the server bench/overload.py starts with --heap-stats (this folder on its PYTHONPATH):
every 10 s, appends glibc's view of the heap to $HEAP_STATS_LOG, to tell memory in use (a leak
grows it) from free memory the heap keeps (fragmentation grows that). glibc only."""

import os

if os.environ.get("HEAP_STATS_LOG"):
    import ctypes
    import threading
    import time

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    def _log(path: str) -> None:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = _MallInfo2
        with open(path, "a") as log:
            while True:
                info = mallinfo2()
                log.write(f"{time.time():.1f} {info.uordblks + info.hblkhd} {info.fordblks}\n")  # in use, free
                log.flush()
                time.sleep(10)

    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018 (glibc 2.33 or later)
        threading.Thread(target=_log, args=(os.environ["HEAP_STATS_LOG"],), daemon=True, name="heap-stats").start()
    except AttributeError:
        pass
