"""kvstore: the cross-request KV-cache metadata store (which engine holds which prefix).

Modules: ``tokenize`` (routing tokenization), ``keys`` (chained block keys), ``index``
(the backend contract), ``memory`` / ``redis_index`` (backends), ``events`` / ``ingest`` /
``feed`` / ``subscriber`` (engine KV events), ``store`` (``KVStore``, what the router
embeds), ``remote`` (``RemoteKVStore``, the same interface over HTTP), ``registry``
(subscriptions from the balancer's worker registry), ``service`` / ``cli`` (the service).
"""
