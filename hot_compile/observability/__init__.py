"""What HOT did, shown through PyTorch's own channels: the last report (``report``), the dumps, logs
and structured traces of the joint graphs (``inspection``), and saved-for-backward bytes
(``memory``)."""
