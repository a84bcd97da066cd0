"""The scripts' machinery, one concern per module (docs/maintainers.md#where-things-are), in a
folder whose name no project gives its own code: a copied script brings common.py and it along.

Order: sigterm, task, machine, data, checkpoint, reporting, launch, flags. A module imports
common.py and the modules before it here, never one after it and never a script
(tests/test_layout.py)."""
