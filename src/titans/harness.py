"""`import titans.harness` registers `--model titans` with lm-evaluation-harness, and `python -m titans.harness ...` is
its command line: the module is `titans.io.harness`, kept here by the name its users have been given."""

from .io.harness import *  # noqa: F401,F403
from .io.harness import __all__, main  # noqa: F401

if __name__ == "__main__":
    main()
