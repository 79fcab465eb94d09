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
"""
import contextlib
import hashlib
import os
import pickle

from numba.core import caching

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


def _keyed_cache_init(self, py_func):
    _numba_cache_init(self, py_func)
    if isinstance(self._impl.locator, _PackageStamp):     # the stamp numba just took
        self._cache_file = KeyedDataCacheFile(self._cache_path, self._impl.filename_base,
                                              self._cache_file._source_stamp)


_keyed_cache_init.keyed = True
if not getattr(caching.Cache.__init__, "keyed", False):   # once, reloads included
    _numba_cache_init = caching.Cache.__init__
    caching.Cache.__init__ = _keyed_cache_init
