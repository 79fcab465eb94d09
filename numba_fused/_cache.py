"""The on-disk cache of the CPU kernels is keyed on every module their code comes from.

numba checks a cached kernel against the hash of the one file that defines it. A
kernel in ``cpu.py`` also holds code inlined from ``_dtypes.py``, ``_lanes.py``
and ``_vecmath.py`` (the conversions, lanes, exp), so a change there alone
(an edit, or an install that rewrites only those files) left the cache serving
the old code. Importing this module registers cache locators that add the hash
of all four files to the stamp of every kernel defined in this package; other
functions keep numba's locators. ``NUMBA_CACHE_DIR`` is honoured as before.
"""
import hashlib
import os

from numba.core import caching

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


class _PackageStamp:
    """A numba locator for this package's files whose stamp includes SOURCES_STAMP."""

    def get_source_stamp(self):
        return (super().get_source_stamp(), SOURCES_STAMP)

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
