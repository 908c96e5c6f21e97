"""Plug-in policies from outside kvcouple: modules named on the command line and installed
packages' entry points.

A plug-in is a module that registers policies when imported (``@register_policy`` on a
:class:`~kvcouple.policies.ScorePolicy` subclass, see :mod:`kvcouple.policies.base`).

- ``kvcouple trace --plugin MODULE`` (repeatable; ``kvcouple demo`` too) imports ``MODULE``,
  an importable module name (installed, or on ``PYTHONPATH``) or the path of a ``.py`` file.
- An installed package registers its policies for every command through the entry point group
  :data:`ENTRY_POINT_GROUP` (``kvcouple.policies``). Each entry point names a module (imported,
  which registers its policies) or a :class:`~kvcouple.policies.Policy` subclass (registered).
  In ``pyproject.toml``::

      [project.entry-points."kvcouple.policies"]
      keynovelty = "mypackage.policies"          # a module that registers policies
      mypolicy = "mypackage.policies:MyPolicy"   # or one Policy subclass

A plug-in that cannot be imported raises :class:`PluginError` naming it (and, for an entry
point, the package that declares it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from kvcouple.policies.base import Policy, register_policy
from kvcouple.policies.errors import PolicyError

ENTRY_POINT_GROUP = "kvcouple.policies"


class PluginError(PolicyError):
    """A plug-in module or entry point that cannot be imported or registers nothing usable."""


def import_plugin(name: str) -> ModuleType:
    """Import one plug-in module (its policies register themselves as it is imported).

    Parameters
    ----------
    name : str
        A module name (``mypackage.policies``) or the path of a ``.py`` file.

    Returns
    -------
    module
        The imported module.

    Raises
    ------
    PluginError
        No such module or file, or the module raised while being imported.
    """
    text = name.strip()
    if not text:
        raise PluginError("--plugin needs a module name or a .py file, got an empty string")
    try:
        if text.endswith(".py") or os.sep in text or "/" in text:
            return _import_file(Path(text).expanduser())
        return importlib.import_module(text)
    except PluginError:
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (text == e.name or text.startswith(e.name + ".")):
            raise PluginError(
                f"--plugin {text}: no module named {text!r} (install it, add its folder to "
                "PYTHONPATH, or give the path of its .py file)"
            ) from e
        raise PluginError(f"--plugin {text}: importing it failed: {e}") from e
    except Exception as e:
        raise PluginError(f"--plugin {text}: importing it failed: {type(e).__name__}: {e}") from e


def _import_file(path: Path) -> ModuleType:
    if not path.is_file() or path.suffix != ".py":
        raise PluginError(f"--plugin {path}: no such .py file")
    module_name = f"kvcouple_plugin_{path.stem}"
    if module_name in sys.modules:  # the same file given twice: import it once
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"--plugin {path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Load every installed entry point of ``group``: import the modules, register the classes.

    Parameters
    ----------
    group : str
        The entry point group (default ``kvcouple.policies``).

    Returns
    -------
    list of str
        The entry points loaded, as ``name = value``.

    Raises
    ------
    PluginError
        An entry point fails to load, or names something that is neither a module nor a
        :class:`~kvcouple.policies.Policy` subclass.
    """
    loaded = []
    for ep in importlib.metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        where = f"entry point {ep.name} = {ep.value} (group {group}" + (
            f", package {dist.name})" if dist is not None else ")"
        )
        try:
            obj = ep.load()
        except Exception as e:
            raise PluginError(
                f"{where} failed to load: {type(e).__name__}: {e} (fix or uninstall that package)"
            ) from e
        if isinstance(obj, type) and issubclass(obj, Policy):
            register_policy(obj)
        elif not isinstance(obj, ModuleType):
            raise PluginError(
                f"{where} is a {type(obj).__name__}, not a module or a Policy subclass"
            )
        loaded.append(f"{ep.name} = {ep.value}")
    return loaded


def load_plugins(modules: Iterable[str] | None = ()) -> list[str]:
    """Make plug-in policies available: the installed entry points, then ``modules``.

    Parameters
    ----------
    modules : iterable of str, optional
        Module names or ``.py`` paths (``--plugin``), imported in order after the entry
        points, so that a module given on the command line can replace an installed policy
        of the same name.

    Returns
    -------
    list of str
        What was loaded: entry points as ``name = value``, then the modules as given.

    Raises
    ------
    PluginError
        See :func:`import_plugin` and :func:`load_entry_points`.
    """
    loaded = load_entry_points()
    for name in modules or ():
        import_plugin(name)
        loaded.append(name)
    return loaded


__all__ = ["ENTRY_POINT_GROUP", "PluginError", "import_plugin", "load_entry_points", "load_plugins"]
