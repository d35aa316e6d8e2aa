"""Scale-out on Ray Serve: model replicas behind a front that holds no model (``ray_app``), the requests carried to
them as ASGI messages (``asgi_bridge``)."""
