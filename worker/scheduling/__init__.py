"""Scheduling: which tokens run in each step, and the KV block pool they live in. Plain data
and integers only: nothing here touches a tensor."""
