"""queue-node: a per-host scheduler node.

`python -m node` runs the supervisor; see README.md and docs/.
"""

__version__ = "0.1.0"
