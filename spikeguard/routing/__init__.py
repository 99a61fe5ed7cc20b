"""Where routing comes from besides the router: the skew injector (synthetic spikes) and
recorded traces, read by training, the simulator and the bench alike."""
