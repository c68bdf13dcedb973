"""ipywidgets views of meshes, shards and collectives (installed as ``dtorch_widgets``)."""
