"""The browsing web UI and JSON API (``schedule-lineage serve``)."""
