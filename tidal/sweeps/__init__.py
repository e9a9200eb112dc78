"""A concurrency sweep's records and their report (tables, plot, JSON, journal), whether the
sweep was measured (tidal bench) or simulated (tidal sim)."""
