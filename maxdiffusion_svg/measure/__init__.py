"""What a configuration loses, measured: each layer's error per budget (calibration) and a
video's distance from the dense one (PSNR, SSIM)."""
