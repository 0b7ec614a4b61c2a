"""The ROS 2 side: the generate node (service, action, lifecycle, diagnostics) and the ask client.
The only room that imports rclpy; it translates parameters, requests and results.

  node.py      the lifecycle node, its endpoints and executables (generate_server, spec-edge serve)
  parameters.py  one typed, described ROS parameter per config key
  worker.py    the request queue and the thread that runs it on the engine
  messages.py  Generate request / response <-> engine request / result; Tokenize
  memory.py    RSS now / peak; freed heap back to the OS after cleanup
  shutdown.py  signal -> exit within 2 s, leaving the ROS graph
  client.py    GenerateClient and `spec-edge ask`

May import: config, runtime.
"""
