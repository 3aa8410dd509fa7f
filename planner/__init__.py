"""autopar's planner: search, plan files, code emission, reports and the command line."""

__version__ = "0.1.0"
