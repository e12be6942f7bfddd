"""The metrics store and what is read from it: the metric definitions (`definitions`), the
SQLite store (`store`), the one recording path (`recording`), the goodput report (`goodput_report`)
and the plots (`plots`). No Ray here: the store's actor lives in `cluster.store_actor`."""
