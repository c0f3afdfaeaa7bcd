"""The exceptions' docstrings are written once, in `_kvmerge.pyi`; the
extension's build copies them into the classes it makes (build.rs). This
checks the built extension against the checkout's stub, so a stale build or a
build that misreads the stub fails here."""

import ast
from pathlib import Path

import pytest

from kvmerge import _kvmerge

STUB = Path(__file__).resolve().parents[2] / "python" / "kvmerge" / "_kvmerge.pyi"


def stub_docs() -> dict[str, str | None]:
    """Each top-level class of the stub and its docstring."""
    tree = ast.parse(STUB.read_text(), filename=str(STUB))
    return {
        node.name: ast.get_docstring(node)
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def exported_exceptions() -> dict[str, type[BaseException]]:
    return {
        name: obj
        for name in _kvmerge.__all__
        if isinstance(obj := getattr(_kvmerge, name), type)
        and issubclass(obj, BaseException)
    }


def test_the_hierarchy_is_exported():
    # Guards the other tests against passing on nothing.
    exported = exported_exceptions()
    assert "KVMergeError" in exported
    assert all(issubclass(cls, _kvmerge.KVMergeError) for cls in exported.values())


@pytest.mark.parametrize("name", sorted(exported_exceptions()))
def test_runtime_doc_is_the_stubs(name):
    docs = stub_docs()
    assert name in docs, f"{name} is exported but has no class in {STUB.name}"
    assert docs[name], f"{name} has no docstring in {STUB.name}"
    assert exported_exceptions()[name].__doc__ == docs[name]


def test_every_stubbed_exception_is_exported():
    tree = ast.parse(STUB.read_text(), filename=str(STUB))
    stubbed = {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and {"Exception", "KVMergeError"} & {ast.unparse(b) for b in node.bases}
    }
    assert stubbed == set(exported_exceptions())
