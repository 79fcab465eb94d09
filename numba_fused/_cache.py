"""The on-disk cache of the CPU kernels: keyed on every module their code comes from,
and safe for processes that fill it at once.

numba checks a cached kernel against the hash of the one file that defines it. A
kernel in ``cpu.py`` also holds code inlined from ``_dtypes.py``, ``_lanes.py``
and ``_vecmath.py`` (the conversions, lanes, exp), so a change there alone
(an edit, or an install that rewrites only those files) left the cache serving
the old code. Importing this module registers cache locators that add the hash
of all four files to the stamp of every kernel defined in this package; other
functions keep numba's locators. ``NUMBA_CACHE_DIR`` is honoured as before.

Each kernel's entries (``KeyedDataCacheFile``) are files named by their key, not
numba's lowest free number. numba picks that number from the index as it read
it, so two processes compiling two signatures of one kernel at once (float16 and
float32, say: ``pytest -n 2``, or a job's workers) could both pick ``.1.nbc``,
and the index could end up naming the other signature's file: every later
process then failed on that signature with a TypingError ("Known signatures:"
the other one) until the cache was deleted (seen 2026-12-07 in this project's
own test run).

A kernel signature is compiled by one process at a time (``_CompileOnce``): a
process that misses it in the cache while another one compiles it waits for that
compile (up to COMPILE_WAIT_S) and loads its entry. Without that, every process
of a job starting on an empty cache compiled every kernel itself (``numba-fused
warmup -j N`` relies on it: its workers share the drivers' out-of-line callees).
"""
import contextlib
import errno
import hashlib
import os
import pickle
import threading
import time

from numba.core import caching
from numba.core import event

try:
    import fcntl
except ImportError:         # Windows: index updates go unlocked (a lost entry is a miss)
    fcntl = None

_HERE = os.path.dirname(os.path.abspath(__file__))
#: the modules whose code a CPU kernel may contain
KERNEL_SOURCES = ("_dtypes.py", "_lanes.py", "_vecmath.py", "cpu.py")


def _sources_hash():
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        with open(os.path.join(_HERE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


#: computed once per process (~0.3 ms)
SOURCES_STAMP = _sources_hash()


#: the layout of the entries (``KeyedDataCacheFile``), in every stamp: an index
#: numba's numbered files wrote, possibly crossed, is stale to this module
LAYOUT = "keyed-1"


class _PackageStamp:
    """A numba locator for this package's files whose stamp includes SOURCES_STAMP."""

    def get_source_stamp(self):
        return (super().get_source_stamp(), SOURCES_STAMP, LAYOUT)

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != _HERE:
            return None
        return super().from_function(py_func, py_file)


# numba's own order: NUMBA_CACHE_DIR, then __pycache__ beside the source, then
# the user-wide directory (read-only installs)
_LOCATORS = [type("Package" + base.__name__, (_PackageStamp, base), {})
             for base in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                          caching.UserWideCacheLocator)]
if not any(issubclass(c, _PackageStamp) for c in caching.CacheImpl._locator_classes):
    caching.CacheImpl._locator_classes[:0] = _LOCATORS


class KeyedDataCacheFile(caching.IndexDataCacheFile):
    """numba's index and data files of one function, with each entry's data file
    named by a hash of its key (signature, target, bytecode) and the source stamp:
    one name per entry, which no other entry and no other version of the sources
    writes. A save writes the data file before the index names it, and updates
    the index under a lock on ``<index>.lock`` (POSIX), so processes saving at
    once keep each other's entries. A load whose data holds another signature
    (a file from elsewhere) is a miss."""

    def data_name(self, key):
        digest = hashlib.sha256(repr((key, self._source_stamp)).encode()).hexdigest()
        return f"{self._index_name[:-len('.nbi')]}.{digest[:20]}.nbc"

    @contextlib.contextmanager
    def _index_lock(self):
        if fcntl is None:
            yield
            return
        try:
            f = open(self._index_path + ".lock", "ab")
        except OSError:         # a read-only cache: numba's save fails on its own
            yield
            return
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def save(self, key, data):
        name = self.data_name(key)
        self._save_data(name, data)
        with self._index_lock():
            overloads = self._load_index()
            if not overloads:
                self._remove_stale_data(keep=name)
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

    def _remove_stale_data(self, keep):
        """Deletes the data files an index of other sources (or of numba's numbered
        layout) names: no process of these sources loads them, and keyed names are
        never reused by another version, so they would pile up with every edit or
        upgrade (numba's numbers were overwritten instead)."""
        try:
            with open(self._index_path, "rb") as f:
                pickle.load(f)
                _, stale = pickle.loads(f.read())
        except Exception:       # no index, or one numba cannot read: nothing named
            return
        for old in set(stale.values()) - {keep}:
            with contextlib.suppress(OSError):
                os.unlink(self._data_path(old))

    def load(self, key):
        data = super().load(key)
        try:
            crossed = tuple(data[3].args) != tuple(key[0])   # CompileResult._reduce()
        except (TypeError, IndexError, AttributeError):
            crossed = False
        return None if crossed else data


#: how long a process waits for another one compiling a kernel signature before
#: compiling it itself (the costliest driver with its callees: ~15 s on 2 cores)
COMPILE_WAIT_S = 300.0
_POLL_S = 0.02

#: lock file -> descriptor, open for the life of the process: the locks are POSIX
#: record locks (a byte of the file per entry), which a process drops on closing
#: any descriptor of the file
_lock_fds = {}
#: (id(cache), key) -> (fd, byte) of the entries this process is compiling
_held = {}
_held_mutex = threading.Lock()


def _lock_fd(path):
    fd = _lock_fds.get(path)
    if fd is None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:         # a read-only cache: no saves to wait for either
            return None
        fd = _lock_fds.setdefault(path, fd)
    return fd


def _try_lock(fd, byte):
    """True: locked; False: another process holds it; None: no locks here (an
    error other than "held", say ENOLCK on a network file system: do not wait)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte)
        return True
    except OSError as e:
        return False if e.errno in (errno.EACCES, errno.EAGAIN) else None


class _CompileOnce:
    """The ``caching.Cache`` of this package's kernels: a miss takes the entry's lock
    (waiting while another process compiles that signature, then loading its entry)
    and holds it until the compile is saved or fails (``_CompileEnd``)."""

    def load_overload(self, sig, target_context):
        data = super().load_overload(sig, target_context)
        if data is not None or fcntl is None or not self._enabled:
            return data
        key = self._index_key(sig, target_context.codegen())
        fd = _lock_fd(self._cache_file._index_path[:-len(".nbi")] + ".compiling")
        if fd is None:
            return None
        byte = int(self._cache_file.data_name(key).rsplit(".", 2)[-2][:12], 16)
        locked = _try_lock(fd, byte)
        if locked is False:                 # another process is compiling it
            deadline = time.monotonic() + COMPILE_WAIT_S
            while locked is False and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                locked = _try_lock(fd, byte)
            if locked:
                data = super().load_overload(sig, target_context)    # its entry
                if data is not None:
                    fcntl.lockf(fd, fcntl.LOCK_UN, 1, byte)
                    return data
        if not locked:          # no locks here, or waited too long: compile unlocked
            return None
        with _held_mutex:
            _held[(id(self), key)] = (fd, byte)
        return None

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
        finally:
            try:
                key = (id(self), self._index_key(sig, data.codegen))
                self._release(lambda k: k == key)
            except Exception:
                self._release(lambda k: k[0] == id(self))

    def _release(self, which):
        with _held_mutex:
            keys = [k for k in _held if which(k)]
            locks = [_held.pop(k) for k in keys]
        for fd, byte in locks:
            with contextlib.suppress(OSError):
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, byte)


class _CompileEnd(event.Listener):
    """Releases the entries a failed compile held (a successful one releases them
    in ``save_overload``)."""

    def on_start(self, ev):
        pass

    def on_end(self, ev):
        # failed: no overload was added (numba 0.68's Event.is_failed reads inverted)
        dispatcher = ev.data.get("dispatcher")
        cache = getattr(dispatcher, "_cache", None)
        if (isinstance(cache, _CompileOnce)
                and tuple(ev.data.get("args", ())) not in dispatcher.overloads):
            cache._release(lambda k: k[0] == id(cache))


_compile_once_classes = {}


def _keyed_cache_init(self, py_func):
    _numba_cache_init(self, py_func)
    if isinstance(self._impl.locator, _PackageStamp):     # the stamp numba just took
        self._cache_file = KeyedDataCacheFile(self._cache_path, self._impl.filename_base,
                                              self._cache_file._source_stamp)
        cls = type(self)
        if cls not in _compile_once_classes:
            _compile_once_classes[cls] = type(cls.__name__, (_CompileOnce, cls), {})
        self.__class__ = _compile_once_classes[cls]


_keyed_cache_init.keyed = True
if not getattr(caching.Cache.__init__, "keyed", False):   # once, reloads included
    _numba_cache_init = caching.Cache.__init__
    caching.Cache.__init__ = _keyed_cache_init
    if fcntl is not None:
        event.register("numba:compile", _CompileEnd())
