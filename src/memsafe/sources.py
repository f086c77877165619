"""How a user's source location prints: notebook cells by their number, directories dropped.

JAX records the file of each traced line. In a notebook that file is a temporary name
(``/tmp/ipykernel_4242/3170521849.py`` under ipykernel, ``<ipython-input-5-1a2b3c>`` in older
IPython); :func:`display_file` names it ``cell [5]`` instead, reading the execution count from the
running IPython's compiler cache when there is one.
"""

from __future__ import annotations

import os
import re
import sys

#: ``<ipython-input-5-1a2b3c4d>``: older IPython puts the execution count in the name.
_IPYTHON_INPUT = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")
#: ``/tmp/ipykernel_4242/3170521849.py``: ipykernel >= 6 writes each cell to a hashed file.
_IPYKERNEL_FILE = re.compile(r"(^|[\\/])ipykernel_\d+[\\/]\d+\.py$")
#: ``file.py:12:4 (fn)`` or ``file.py:12 (fn)``: a location as JAX and memsafe print it.
_LOCATION = re.compile(r"^(?P<file>.+?):(?P<rest>\d+(?::\d+)?(?: \(.*\))?)$")


def _cell_number(filename: str) -> int | None:
    """The execution count IPython gave the cell compiled to ``filename`` (None if unknown)."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None) if ipython is not None else None
    shell = get() if get is not None else None
    cache = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(cache, dict) and isinstance(cache.get(filename), int):
        return cache[filename]
    return None


def is_notebook_cell(filename: str) -> bool:
    """Whether ``filename`` is the name IPython gives a cell's code."""
    return bool(_IPYTHON_INPUT.match(filename) or _IPYKERNEL_FILE.search(filename))


def display_file(filename: str) -> str:
    """``cell [5]`` for a notebook cell, else the file's base name (``knn.py``).

    Args:
        filename: a file name as Python's code objects carry it.

    Returns:
        The short name a report shows.
    """
    match = _IPYTHON_INPUT.match(filename)
    if match:
        return f"cell [{match.group(1)}]"
    if _IPYKERNEL_FILE.search(filename):
        number = _cell_number(filename)
        return f"cell [{number}]" if number is not None else "notebook cell"
    return os.path.basename(filename) or filename


def short_location(text: str) -> str:
    """A location ``/dir/file.py:12 (fn)`` printed as ``file.py:12 (fn)`` or ``cell [3]:12 (fn)``.

    Args:
        text: a location as ``str(Source)`` or JAX's source summary prints it; anything else is
            returned unchanged.

    Returns:
        The location with the directory dropped and notebook cells named.
    """
    match = _LOCATION.match(text)
    if not match:
        return text
    return f"{display_file(match.group('file'))}:{match.group('rest')}"


#: An absolute ``.py`` path or an IPython cell name inside a longer text.
_PATH_IN_TEXT = re.compile(r"(?<![\w.])(?:/[^\s:()]+\.py|<ipython-input-\d+-[0-9a-f]+>)")


def shorten_paths(text: str) -> str:
    """Every absolute ``.py`` path in ``text`` as :func:`display_file` names it.

    Args:
        text: a line of a plan or report, e.g. ``split f32[...] (add at /home/me/knn.py:4:8)``.

    Returns:
        The line with ``knn.py:4:8``, or ``cell [3]:4:8`` for a notebook cell.
    """
    return _PATH_IN_TEXT.sub(lambda m: display_file(m.group(0)), text)
