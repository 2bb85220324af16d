"""The model (core layer, no I/O): ``config`` and ``options`` (no torch), ``layers``, ``dit``, ``projector``. This
package imports nothing, so that ``dit.cost`` reads the config without torch."""
