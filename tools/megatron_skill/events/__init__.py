"""Training events: the emitters' side (event, emit), the handler's record (ledger) and the
intended actions worked out from an event (actions); the on-event tool puts them together."""
