"""The kernel side of `zeroedu grade`: what runs inside the sandbox, next to the learner's code.

The grader never runs a test in the learner's kernel. It runs the learner's cells there, then asks for values:
"call your `model_state_bytes` with these arguments", "train your `MyStage1` on these cases and hand back what
every rank measured". While the grader runs one test cell, `serve(token)` runs in the kernel and answers its
requests through two named pipes in the work folder: each request is pickled by the grader, each answer is
plain data only (tensors, numbers, strings, lists, dicts) that the grader loads with
`torch.load(weights_only=True)` and judges in its own process.

`apply_blocks()` replaces the engine pieces an exercise asks the learner to write (a stage's `reduce_bucket`,
`zeropp.quantize`, ...) by versions that raise "write your own" whenever learner code is involved: an engine
whose class has a learner class in its MRO (so `class MyStage1(Stage1): pass` and a bare `super()` call fail),
or a call made from a learner's frame (so wrapping `zeropp.quantize` fails). The engine's own runs, which the
checks compare against, are untouched. The grader lists the pieces in a read-only file inside the sandbox;
sitecustomize (guard/) applies them in every Python process there, the ranks' forkserver included.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import json
import os
import pickle
import sys
import sysconfig
import threading
import traceback
import weakref
from typing import Any

from zeroedu.i18n import tr

CONFIG_PATH = "/run/zeroedu-grade/config.json"   # bound read-only into the sandbox by the grader
EXCHANGE = ".zeroedu-exchange"                   # kept for old imports; the pipes no longer live in the work folder
EXCHANGE_PATH = "/run/zeroedu-grade/exchange"    # the grader's folder of test pipes, bound read-only in the sandbox
MAX_MESSAGE = 2000                               # characters of an exception message sent back
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOT_LEARNER = tuple(p for p in {_PKG, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                 sysconfig.get_paths()["platlib"], os.path.dirname(os.__file__)} if p)
_ROOTS = tuple({os.path.realpath(p).rstrip(os.sep) + os.sep for p in _NOT_LEARNER})


def _under_roots(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_ROOTS)


def config() -> dict:
    """The grader's settings for this sandbox: {"blocks": [...]} ({} when not grading)."""
    for path in (CONFIG_PATH, os.environ.get("ZEROEDU_GRADE_CONFIG", "")):
        if path and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    return json.load(f)
            except (OSError, ValueError):
                return {}
    return {}


# -- who is calling --------------------------------------------------------------------------------------------
#
# "Library code" is decided positively: a frame is zeroedu's, torch's or Python's own only when its file really
# exists under one of the read-only roots above (or is a module frozen into the interpreter) AND its code object
# is one that file compiles to. A name is not enough: learner code compiled with compile(src, '/usr/lib/python3/x',
# ...) or a 'site-packages' file name, or a class whose __module__ is set to 'zeroedu.stages.stage1', is still
# the learner's.

_CODES: dict[str, frozenset | None] = {}       # file name -> every code object it compiles to (None: not library)
_VERDICTS: dict[Any, bool] = {}                # code object -> is library code


def _all_codes(code: Any, out: set) -> set:
    out.add(code)
    for const in code.co_consts:
        if isinstance(const, type(code)):
            _all_codes(const, out)
    return out


def _compiled(filename: str) -> Any:
    """The module code of a library file: its fresh .pyc when there is one (what import loaded), else compiled."""
    import importlib.util
    import marshal

    with open(filename, "rb") as f:
        source = f.read()
    try:
        pyc = importlib.util.cache_from_source(filename)
        with open(pyc, "rb") as f:
            data = f.read()
        st = os.stat(filename)
        flags = int.from_bytes(data[4:8], "little")
        if data[:4] == importlib.util.MAGIC_NUMBER and flags == 0 and \
                int.from_bytes(data[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF and \
                int.from_bytes(data[12:16], "little") == st.st_size & 0xFFFFFFFF:
            return marshal.loads(data[16:])
    except (OSError, ValueError, EOFError, TypeError, NotImplementedError):
        pass
    return compile(source, filename, "exec", dont_inherit=True)


def _library_codes(filename: str) -> frozenset | None:
    if filename in _CODES:
        return _CODES[filename]
    codes = None
    try:
        if filename.startswith("<frozen ") and filename.endswith(">"):
            import _imp

            name = filename[len("<frozen "):-1]
            for candidate in (name, "_frozen_importlib" if name == "importlib._bootstrap" else "",
                              "_frozen_importlib_external" if name == "importlib._bootstrap_external" else ""):
                if candidate and _imp.is_frozen(candidate):
                    codes = frozenset(_all_codes(_imp.get_frozen_object(candidate), set()))
                    break
        elif os.path.isabs(filename) and filename.endswith(".py") and _under_roots(filename) \
                and os.path.isfile(filename):
            codes = frozenset(_all_codes(_compiled(filename), set()))
    except (OSError, SyntaxError, ValueError, ImportError, MemoryError):
        codes = None
    _CODES[filename] = codes
    return codes


def is_library_code(code: Any) -> bool:
    """True for a code object of zeroedu, torch or the standard library as its real file compiles it."""
    verdict = _VERDICTS.get(code)
    if verdict is None:
        codes = _library_codes(code.co_filename)
        verdict = _VERDICTS[code] = codes is not None and code in codes
    return verdict


def _is_learner_file(filename: str) -> bool:
    """For tracebacks only (a frame's text): a file outside the library roots."""
    return not filename.startswith(_NOT_LEARNER) and not filename.startswith("<frozen") and "site-packages" \
        not in filename and "/lib/python3" not in filename


def learner_on_stack() -> str | None:
    """The innermost frame of learner code (a notebook cell, exec'd text, anything that is not library code)
    between here and the grader's request, as "function, line N", or None."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is answer.__code__:
            return None
        # The outermost frame is the process's own start (`python -c ...` of multiprocessing's forkserver).
        if frame.f_back is not None and not is_library_code(frame.f_code):
            return f"{frame.f_code.co_name}, line {frame.f_lineno} of {frame.f_code.co_filename}"
        frame = frame.f_back
    return None


def _functions(cls: type) -> list[Any]:
    out = []
    for value in vars(cls).values():
        for fn in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                   getattr(value, "fset", None)):
            code = getattr(fn, "__code__", None)
            if isinstance(code, type(answer.__code__)):
                out.append(code)
    return out


def _is_learner_class(cls: type) -> bool:
    """Not zeroedu's, torch's or Python's: defined in a notebook cell or exec'd text. A class counts as the
    library's only when its module is a real library module and every function in its own body is library code
    (so a learner class that sets __module__ = 'zeroedu.stages.stage1' is still the learner's)."""
    if any(not is_library_code(code) for code in _functions(cls)):
        return True
    module = getattr(cls, "__module__", "") or ""
    if not isinstance(module, str) or module == "__main__":
        return True
    loaded = sys.modules.get(module)
    if loaded is None:
        return module != "builtins"
    filename = getattr(loaded, "__file__", None)
    if filename is None:
        origin = getattr(getattr(loaded, "__spec__", None), "origin", None)
        return not (module in sys.builtin_module_names or origin in ("built-in", "frozen"))
    filename = str(filename)
    if not filename.endswith(".py"):   # an extension module: a real file under the read-only roots
        return not (_under_roots(filename) and os.path.isfile(filename))
    return _library_codes(filename) is None


def learner_class(obj: Any) -> str | None:
    """The name of the first learner class in obj's type's MRO, or None."""
    for cls in type(obj).__mro__:
        if _is_learner_class(cls):
            return cls.__qualname__
    return None


# -- who started a thread, who made an engine ------------------------------------------------------------------
#
# A worker thread's stack begins in threading's own code: zeropp.quantize submitted to a ThreadPoolExecutor from
# a learner's function shows no learner frame when it runs. So every new thread remembers the learner frame
# that was on the stack of the thread that started it (inherited by the threads it starts in turn), and a blocked
# piece reached in that thread counts as reached by learner code. Likewise an engine object remembers whether
# learner code made it: `self.__class__ = Stage1` in a learner's class turns it into zeroedu's class, but not
# into an engine the grader made.

_ORIGIN = threading.local()                                 # .where: the learner frame that started this thread
_MADE_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # engine object -> learner who made it


def thread_origin() -> str | None:
    return getattr(_ORIGIN, "where", None)


def _track_threads() -> None:
    """Wrap the functions that start a thread (start_new_thread; on Python 3.13 Thread.start calls
    start_joinable_thread instead) so that the new thread remembers the learner frame that started it."""
    import _thread

    for name, alias in (("start_new_thread", "_start_new_thread"), ("start_joinable_thread", "_start_joinable_thread")):
        start = getattr(_thread, name, None)
        if start is None or getattr(start, "_zeroedu_blocked", False):
            continue

        def starting(function: Any, *args: Any, _start: Any = start, **kwargs: Any) -> Any:
            where = learner_on_stack() or thread_origin()

            def run(*a: Any, **k: Any) -> Any:
                _ORIGIN.where = where
                return function(*a, **k)

            return _start(run, *args, **kwargs)

        starting._zeroedu_blocked = True   # type: ignore[attr-defined]
        setattr(_thread, name, starting)
        setattr(threading, alias, starting)   # what Thread.start calls


def _track_construction(cls: type) -> None:
    init = cls.__init__
    if getattr(init, "_zeroedu_blocked", False) and "__init__" in vars(cls):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        who = learner_class(self) or learner_on_stack()
        if who is not None:
            with contextlib.suppress(TypeError):   # an object that takes no weak reference keeps no record
                _MADE_BY.setdefault(self, who)
        init(self, *args, **kwargs)

    cls.__init__ = _like(__init__, init)   # type: ignore[misc]


def _made_by_learner(obj: Any) -> str | None:
    try:
        return _MADE_BY.get(obj)
    except TypeError:
        return None


# -- what the learner must write ---------------------------------------------------------------------------------

class WriteYourOwn(NotImplementedError):
    """Raised by an engine piece that the exercise asks the learner to write."""


def _message(target: str, who: str) -> str:
    return tr(f"{target} is the part this exercise asks you to write; while grading, zeroedu's own raises this "
              f"error when {who} reaches it. Write the body yourself (no super() call, no call to zeroedu's "
              "version).",
              f"{target} 是本练习要你自己写的部分；评分时，{who}一调用到 zeroedu 自己的版本就会抛出这个错误。"
              "请自己写出函数体（不要调用 super()，也不要调用 zeroedu 的版本）。")


def _like(blocked: Any, original: Any) -> Any:
    """Name and document the blocked version as the original, without functools.wraps: its __wrapped__ would
    hand learner code the original. The original lives only in the blocked function's closure."""
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(blocked, attr, getattr(original, attr))
    blocked._zeroedu_blocked = True
    return blocked


def _block_method(cls: type, name: str, label: str) -> None:
    original = getattr(cls, name)
    if getattr(original, "_zeroedu_blocked", False):
        return

    def blocked(self: Any, *args: Any, **kwargs: Any) -> Any:
        who = learner_class(self)
        if who is not None:
            raise WriteYourOwn(_message(label, tr(f"your class {who}", f"你的类 {who} ")))
        made = _made_by_learner(self)
        if made is not None:
            raise WriteYourOwn(_message(label, tr(f"an object your code made ({made}), whatever its class now",
                                                  f"你的代码创建的对象（{made}，不论它现在是什么类）")))
        where = learner_on_stack() or thread_origin()
        if where:
            raise WriteYourOwn(_message(label, tr(f"your code ({where})", f"你的代码（{where}）")))
        return original(self, *args, **kwargs)

    setattr(cls, name, _like(blocked, original))


def _block_function(module: Any, name: str, label: str) -> None:
    original = getattr(module, name)
    if getattr(original, "_zeroedu_blocked", False):
        return

    def blocked(*args: Any, **kwargs: Any) -> Any:
        where = learner_on_stack() or thread_origin()
        if where:
            raise WriteYourOwn(_message(label, tr(f"your code ({where})", f"你的代码（{where}）")))
        return original(*args, **kwargs)

    setattr(module, name, _like(blocked, original))


def apply_blocks(targets: list[str] | None = None) -> list[str]:
    """Block each "module:Name" or "module:Class.method"; return the ones that do not exist (a stale list)."""
    missing = []
    targets = config().get("blocks", []) if targets is None else targets
    if targets:
        _track_threads()
    for target in targets:
        module_name, _, qualname = target.partition(":")
        try:
            module = importlib.import_module(module_name)
            owner: Any = module
            parts = qualname.split(".")
            for part in parts[:-1]:
                owner = getattr(owner, part)
            getattr(owner, parts[-1])
        except (ImportError, AttributeError):
            missing.append(target)
            continue
        label = qualname if len(parts) > 1 else f"{module_name.rsplit('.', 1)[-1]}.{qualname}"
        if isinstance(owner, type):
            _block_method(owner, parts[-1], label)
            _track_construction(owner)
        else:
            _block_function(owner, parts[-1], label)
    return missing


# -- answering the grader ----------------------------------------------------------------------------------------

def _namespace() -> dict:
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
    except ImportError:
        pass
    return sys.modules["__main__"].__dict__


def user(path: str) -> Any:
    """The learner's object called `path` ("name" or "name.attr"); NameError as Python says it."""
    name, *attrs = path.split(".")
    ns = _namespace()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined")
    obj = ns[name]
    for attr in attrs:
        obj = getattr(obj, attr)
    return obj


def plain(x: Any, depth: int = 0) -> Any:
    """x as data the grader can load with weights_only=True: anything else becomes {"__object__": type name}."""
    import torch

    if depth > 20:
        return {"__object__": "a structure nested too deep"}
    if x is None or isinstance(x, bool | int | float | str | bytes | torch.dtype):
        return x
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, torch.Size):
        return tuple(int(v) for v in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {"__namedtuple__": type(x).__name__, "fields": [str(f) for f in x._fields],
                "values": [plain(v, depth + 1) for v in x]}
    if isinstance(x, list | tuple):
        items = [plain(v, depth + 1) for v in x]
        return items if isinstance(x, list) else tuple(items)
    if isinstance(x, dict):
        return {plain(k, depth + 1) if isinstance(k, int | float | str | bool | tuple) or k is None
                else repr(k)[:100]: plain(v, depth + 1) for k, v in x.items()}
    return {"__object__": type(x).__name__}


def _error(e: BaseException) -> dict:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_learner_file(f.filename)]
    where = ""
    if frames:
        f = frames[-1]
        where = f" in {f.name}, line {f.lineno} of its cell" + (f": {f.line.strip()[:200]}" if f.line else "")
    return {"type": type(e).__name__, "builtin": getattr(builtins, type(e).__name__, None) is type(e),
            "message": str(e)[:MAX_MESSAGE], "where": where}


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, type(code)):
            names |= _code_names(const)
    return names


def check_harness(fn: Any) -> None:
    """The grader's own harness function (in_kernel), as pickle found it here by name: it must still be
    zeroedu's code, and so must the zeroedu functions and classes it names in its module. A learner who rebinds
    `zeroedu.grading.exercises.training._collect` (or the `run_on_ranks` it calls) to return made-up rows gets
    this error, not the rows. (Deeper rebinding, inside what those call, is beyond this check.)"""
    code = getattr(fn, "__code__", None)
    if code is None or not is_library_code(code):
        what = repr(getattr(fn, "__qualname__", fn))
        raise WriteYourOwn(tr(f"the grader's harness function {what} was replaced by code of yours in this kernel: "
                              "the grader does not trust what it returns",
                              f"评分器的测试函数 {what} 在这个 kernel 里被你的代码替换了：评分器不信任它的返回值"))
    globs = getattr(fn, "__globals__", {})
    for name in _code_names(code):
        value = globs.get(name)
        target = getattr(value, "__func__", value)
        if isinstance(target, type):
            if _is_learner_class(target):
                raise WriteYourOwn(tr(f"{name}, which the grader's harness uses, was replaced by a class of yours",
                                      f"评分器的测试用到的 {name} 被替换成了你的类"))
        elif isinstance(getattr(target, "__code__", None), type(code)) and not is_library_code(target.__code__):
            raise WriteYourOwn(tr(f"{name}, which the grader's harness uses, was replaced by code of yours in this "
                                  "kernel: the grader does not trust what it returns",
                                  f"评分器的测试用到的 {name} 在这个 kernel 里被你的代码替换了："
                                  "评分器不信任它的返回值"))


def answer(request: dict) -> dict:
    """Call what the grader's request names; {"value": plain data} or {"error": what was raised}."""
    try:
        fn = request["fn"]
        if isinstance(fn, str):
            fn = user(fn)
        else:   # a harness function, sent by reference: still zeroedu's own?
            check_harness(fn)
        return {"value": plain(fn(*request["args"], **request["kwargs"]))}
    except BaseException as e:  # noqa: BLE001 -- KeyboardInterrupt too: the grader's time limit interrupted it
        return {"error": _error(e)}


def serve(token: str, folder: str = EXCHANGE_PATH) -> None:
    """Answer the grader's requests for one test cell, until it says it is done (a zero-length request).

    Requests come through the named pipe `<token>.in` in the grader's exchange folder (8-byte length, then a
    pickle written by the grader: names of learner objects resolve here, see `user`), answers go back through
    `<token>.out`
    (8-byte length, then torch.save of plain data). An interrupt (the test's time limit) ends the loop."""
    import io

    import torch

    with open(os.path.join(folder, f"{token}.in"), "rb") as requests, \
            open(os.path.join(folder, f"{token}.out"), "wb") as answers:
        while True:
            head = requests.read(8)
            size = int.from_bytes(head, "big") if len(head) == 8 else 0
            if size == 0:
                return
            data = requests.read(size)
            try:
                result = answer(pickle.loads(data))
            except BaseException as e:  # noqa: BLE001 -- a name that does not resolve, an interrupt
                result = {"error": _error(e)}
            buffer = io.BytesIO()
            torch.save(result, buffer)
            out = buffer.getvalue()
            answers.write(len(out).to_bytes(8, "big") + out)
            answers.flush()
            if result.get("error", {}).get("type") == "KeyboardInterrupt":
                return
