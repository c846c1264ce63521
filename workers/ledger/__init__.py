"""The ledger process (``python -m workers.ledger``): the single writer of
the completion log (``process``), with its job ready queues and two-phase
delivery (``delivery``) and the accounting law (``accounting``)."""
