"""The end-to-end benchmark (``fastload bench``): generated data, one process per system,
the report. ``e2e_bench`` runs it; the rest are its parts."""
