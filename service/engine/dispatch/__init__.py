"""Dispatch: running a plan on the replicas.

:mod:`.cluster` connects to Ray; :mod:`.executor` computes a request type (the response cache, the
plan, the replicas, the figures); :mod:`.dispatcher` hands steps to free replicas with bounded
waits and failover; :mod:`.phases` keeps each request type's figures and progress;
:mod:`.heap` keeps the driver's heap out of the collector's full passes while it runs;
:mod:`.warm` carries loaded replicas from one evaluation to the next.
"""
