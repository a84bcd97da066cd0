"""The scripts' machinery, one concern per module (docs/maintainers.md#where-things-are): what
is not about distribution, which the lesson never opens. A script copied into a project takes
common.py and this folder with it. The folder's name is one that no project gives its own code,
so a project's own `data/` or `checkpoint/` package cannot stand in for a module here.

Order: sigterm, task, machine, data, checkpoint, reporting, launch, flags. A module imports
common.py and the modules before it here, never one after it and never a script
(tests/test_layout.py)."""
