"""Fault points live in sluicegate/faults.py (below every package that has one); this name stays for the
modules that still import it from here."""

from ..faults import fault_point

__all__ = ["fault_point"]
