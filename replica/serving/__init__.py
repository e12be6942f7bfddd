"""One replica on the wire: the asyncio serving loop around the engine (`loop`, no Ray) and the
Ray actor that carries its calls (`actor`)."""
