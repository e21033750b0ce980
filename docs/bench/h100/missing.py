"""Print the wheel-name prefixes of the packages this machine's python3 lacks."""
import importlib

NEED = {"typer": "typer", "click": "click", "rich": "rich", "shellingham": "shellingham",
        "markdown_it": "markdown_it_py", "mdurl": "mdurl", "pygments": "pygments",
        "typing_extensions": "typing_extensions", "hypothesis": "hypothesis", "sortedcontainers": "sortedcontainers",
        "attr": "attrs", "pytest": "pytest", "pluggy": "pluggy", "iniconfig": "iniconfig", "packaging": "packaging",
        "xdist": "pytest_xdist", "execnet": "execnet", "yaml": "pyyaml", "tqdm": "tqdm",
        "pydantic": "pydantic", "typing_inspection": "typing_inspection", "annotated_types": "annotated_types"}
for module, wheel in NEED.items():
    try:
        m = importlib.import_module(module)
        print("have", module, getattr(m, "__version__", ""), flush=True, file=__import__("sys").stderr)
    except Exception:
        print(wheel)
        if module == "pydantic":
            print("pydantic_core")
